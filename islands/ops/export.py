"""`islands export RUN [--round N] OUT`: a published round as the files its users' tools load.

For a Hugging Face model, a folder `AutoModelForCausalLM.from_pretrained(OUT)` loads: transformers
itself writes config.json, model.safetensors (a tied weight once, as it expects) and
generation_config.json. For a preset or a factory, the synced weights as model.safetensors and a
config.json naming the model. Beside them, always, the files `AutoTokenizer.from_pretrained(OUT)`
loads, of the tokenizer the run's ids came from: the run's `tokenizer`, else the one its token
shards were made with (the copy `islands prepare` keeps beside them), else bytes, as a byte-level
tokenizer whose ids are the bytes. Never a model folder's own tokenizer, which a run without one
did not train on.

Nothing is written before OUT is known to be reachable, outside every bucket of the run's store,
free of files this export would not write itself, and the checkpoint's sha256 matches its
manifest. A file already at OUT with the very bytes the export writes is left as it is; one with
other bytes is replaced only with `force`, and then by a new file, never by writing through it.
"""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import fsspec

from islands.core.config import GLOBAL_BUCKET
from islands.core.model import PRESETS, assign_params, is_hf, skeleton
from islands.storage.codec import encode_state
from islands.storage.corpus import CorpusError, shards_tokenizer
from islands.storage.manifest import Manifest
from islands.storage.model_files import check_writable, is_remote, local_model
from islands.storage.rounds import get_tensors, latest_round, read_config, read_manifest
from islands.storage.store import ObjectMissing, Stores, bucket_holding
from islands.storage.tokenizer import save_tokenizer


class ExportError(ValueError):
    """What keeps a round from being exported, in one line."""


def export_round(
    stores: Stores, run: str, round_: int | None, out: str, force: bool = False
) -> tuple[Manifest, list[str]]:
    """Write round `round_` (default: the newest) of `run` to `out`; its manifest and the names
    written. `force`: replace files at OUT that hold other bytes than the export's."""
    bucket = bucket_holding(out, stores.template, [GLOBAL_BUCKET, *stores.regions])
    if bucket is not None:
        raise ExportError(
            f"OUT: {out} is inside {bucket}, a bucket of the run's store, whose objects only the run writes; "
            "give a folder outside the store"
        )
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
            # canonical bytes (sorted metadata), so the same round exports the same file every time
            (folder / "model.safetensors").write_bytes(encode_state(params, {"run": run, "round": str(r)}))
            described = {"model": config.model, "run": run, "round": r, "sha256": manifest.model.sha256}
            if config.model in PRESETS:
                described["config"] = asdict(PRESETS[config.model])
            (folder / "config.json").write_text(json.dumps(described, indent=1) + "\n")
        return manifest, put_new(folder, out, force)


def put_new(local: Path, out: str, force: bool) -> list[str]:
    """Copy the files of `local` into `out` (a folder or an fsspec URL) and return their names,
    sorted. A file already at OUT with the same bytes stays as it is; one with other bytes (or
    a folder of that name) is refused with ExportError, nothing written, unless `force`."""
    names = sorted(p.name for p in local.iterdir() if p.is_file())
    fs, root = fsspec.url_to_fs(out) if is_remote(out) else (None, out.removeprefix("file://"))
    differ = [name for name in names if _differs(local / name, fs, f"{root.rstrip('/')}/{name}")]
    if differ and not force:
        shown = ", ".join(differ[:4]) + (f" and {len(differ) - 4} more" if len(differ) > 4 else "")
        raise ExportError(
            f"OUT: {out} already holds {shown}, with other bytes than this export's; nothing written: "
            "give an empty folder, or --force to replace them"
        )
    for name in names:
        source, target = local / name, f"{root.rstrip('/')}/{name}"
        if fs is not None:
            if name in differ or not fs.exists(target):
                fs.put_file(str(source), target)
            continue
        Path(root).mkdir(parents=True, exist_ok=True)
        if name not in differ and os.path.lexists(target):
            continue
        fd, partial = tempfile.mkstemp(dir=root, prefix=f".{name}.")
        try:
            with os.fdopen(fd, "wb") as fh, open(source, "rb") as src:
                while chunk := src.read(1 << 20):
                    fh.write(chunk)
            if name in differ:
                os.replace(partial, target)  # a new file in its place: never written through a link
            else:
                os.link(partial, target)  # create-only: a file made meanwhile is not replaced
        except FileExistsError:
            raise ExportError(f"OUT: {target} appeared while the export wrote; nothing replaced") from None
        except OSError as exc:  # a folder in the file's place, a full disk
            raise ExportError(f"OUT: {target} cannot be written ({exc.strerror or exc})") from None
        finally:
            if os.path.lexists(partial):
                os.unlink(partial)
    return names


def _differs(source: Path, fs, target: str) -> bool:
    """Whether something is at `target` that is not a file with `source`'s bytes."""
    if fs is None:
        if not os.path.lexists(target):
            return False
        return not (os.path.isfile(target) and filecmp.cmp(source, target, shallow=False))
    if not fs.exists(target):
        return False
    if not fs.isfile(target) or fs.size(target) != source.stat().st_size:
        return True
    theirs, ours = hashlib.sha256(), hashlib.sha256()
    with fs.open(target, "rb") as fh:
        while chunk := fh.read(1 << 20):
            theirs.update(chunk)
    with open(source, "rb") as fh:
        while chunk := fh.read(1 << 20):
            ours.update(chunk)
    return theirs.digest() != ours.digest()
