"""`islands export RUN [--round N] OUT`: a published round as the files its users' tools load.

For a Hugging Face model, a folder `AutoModelForCausalLM.from_pretrained(OUT)` loads: transformers
itself writes config.json, model.safetensors (a tied weight once, as it expects) and
generation_config.json. For a preset or a factory, the synced weights as model.safetensors and a
config.json naming the model. Beside them, always, the files `AutoTokenizer.from_pretrained(OUT)`
loads, of the tokenizer the run's ids came from: the run's `tokenizer`, else the one its token
shards were made with (the copy `islands prepare` keeps beside them), else bytes, as a byte-level
tokenizer whose ids are the bytes. Never a model folder's own tokenizer, which a run without one
did not train on.

Nothing is written before OUT is known to be reachable and the checkpoint's sha256 matches its
manifest.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict
from pathlib import Path

from safetensors.torch import save_file

from islands.core.model import PRESETS, assign_params, is_hf, skeleton
from islands.storage.corpus import CorpusError, shards_tokenizer
from islands.storage.manifest import Manifest
from islands.storage.model_files import check_writable, local_model, put_folder
from islands.storage.rounds import get_tensors, latest_round, read_config, read_manifest
from islands.storage.store import ObjectMissing, Stores
from islands.storage.tokenizer import save_tokenizer


class ExportError(ValueError):
    """What keeps a round from being exported, in one line."""


def export_round(stores: Stores, run: str, round_: int | None, out: str) -> tuple[Manifest, list[str]]:
    """Write round `round_` (default: the newest) of `run` to `out`; its manifest and the names written."""
    check_writable(out)
    store = stores.global_
    config = read_config(store, run)
    newest = latest_round(store, run)
    r = newest if round_ is None else round_
    if r is None:
        raise ExportError(f"{run}: no round is published yet")
    try:
        manifest, _ = read_manifest(store, run, r)
    except ObjectMissing:
        raise ExportError(f"--round {r}: {run} has no such round (newest: {newest})") from None
    params = get_tensors(store, manifest.model)  # its sha256 checked against the manifest
    spec = local_model(config.model)
    model = skeleton(spec, config.seed)
    assign_params(model, params)
    tokenizer = config.tokenizer
    if tokenizer is None:
        try:
            tokenizer = shards_tokenizer(config.corpus, config.eval_corpus)
        except CorpusError as exc:
            raise ExportError(f"{exc} (the tokenizer {run}'s ids came from)") from None
    with tempfile.TemporaryDirectory(prefix="islands-export-") as tmp:
        folder = Path(tmp)
        save_tokenizer(tokenizer, folder)  # None: bytes
        if is_hf(model):
            model.save_pretrained(folder)
        else:
            save_file(params, folder / "model.safetensors", metadata={"run": run, "round": str(r)})
            described = {"model": config.model, "run": run, "round": r, "sha256": manifest.model.sha256}
            if config.model in PRESETS:
                described["config"] = asdict(PRESETS[config.model])
            (folder / "config.json").write_text(json.dumps(described, indent=1) + "\n")
        return manifest, put_folder(folder, out)
