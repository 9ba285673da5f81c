"""`islands export`: a round's checkpoint, its sha256 checked first, as files safetensors or
transformers load, with the run's tokenizer as AutoTokenizer loads it; an OUT it cannot reach, a
tokenizer that is gone or a damaged checkpoint stops it before it writes."""

from pathlib import Path

import pytest
import torch
from hf_models import train_bpe, write_llama
from safetensors.torch import load_file

from islands.core.config import RunConfig
from islands.core.model import build_model, params_of
from islands.flows.cli import main
from islands.storage import layout
from islands.storage.rounds import read_manifest
from islands.storage.store import Stores
from islands.storage.text import stdlib_files
from islands.tasks.publish import publish_initial

RUN = "export-run"


def round0(
    tmp_path: Path, model: str, tokenizer: str | None = None, corpus: str = "stdlib", run: str = RUN
) -> tuple[str, Stores]:
    """A run with its config and round 0 in folders, as the driver writes them."""
    template = f"file://{tmp_path}/store/{{bucket}}"
    config = RunConfig(
        run_id=run,
        regions=["north"],
        speed={},
        model=model,
        tokenizer=tokenizer,
        corpus=corpus,
        eval_every=0,
        store=template,
        quorum={"min_quorum": 1},
    )
    return template, driver(config)


def driver(config: RunConfig) -> Stores:
    """What the driver writes first: the run's config and round 0."""
    stores = Stores(config.store, config.regions)
    stores.global_.put_if_absent(layout.config_key(config.run_id), config.model_dump_json().encode())
    publish_initial(config, config.run_id, stores)
    return stores


def test_a_preset_round_is_written_as_safetensors_and_its_config(tmp_path):
    template, _ = round0(tmp_path, "tiny")
    assert main(["export", RUN, str(tmp_path / "out"), "--store", template, "--round", "0"]) == 0
    got = load_file(tmp_path / "out" / "model.safetensors")
    want = params_of(build_model("tiny", 0))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert '"n_layer": 4' in (tmp_path / "out" / "config.json").read_text()


def test_an_hf_round_loads_in_transformers_with_its_tie(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = write_llama(tmp_path / "llama")
    template, _ = round0(tmp_path, str(folder))
    assert main(["export", RUN, str(tmp_path / "out"), "--store", template]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    want = params_of(build_model(str(folder), 0))
    assert all(torch.equal(v, want[k]) for k, v in params_of(loaded).items())


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    return train_bpe([str(p) for p in stdlib_files()[:5]], tmp_path_factory.mktemp("tok") / "tokenizer.json", 300)


@pytest.mark.parametrize(
    ("model", "form"),
    [("llama", "tokenizer.json"), ("llama", "folder"), ("tiny", "tokenizer.json")],
)
def test_the_runs_tokenizer_is_written_as_autotokenizer_loads_it(tmp_path, tokenizer_json, model, form):
    """The run's tokenizer.json is wrapped, a tokenizer folder's files are copied (a run without
    one exports bytes, even for a model folder with a tokenizer of its own: test_liveness_models)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    llama = write_llama(tmp_path / "llama")
    folder = tmp_path / "tok"
    if form == "folder":
        PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), eos_token="<|endoftext|>").save_pretrained(folder)
    tokenizer = str(folder) if form == "folder" else str(tokenizer_json)
    template, _ = round0(tmp_path, str(llama) if model == "llama" else model, tokenizer)
    assert main(["export", RUN, str(tmp_path / "out"), "--store", template]) == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "def main():\n    return 1"
    ids = tok(text).input_ids
    assert len(ids) < len(text) and max(ids) < 300 and tok.decode(ids) == text
    assert tok.eos_token == "<|endoftext|>" and tok.convert_tokens_to_ids("<|endoftext|>") == tok.eos_token_id


def test_a_runs_tokenizer_that_is_gone_writes_nothing(tmp_path, tokenizer_json, capsys):
    template, _ = round0(tmp_path, "tiny", str(tmp_path / "gone.json"))
    assert main(["export", RUN, str(tmp_path / "out"), "--store", template]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"islands: tokenizer: {tmp_path / 'gone.json'} does not exist")
    assert not (tmp_path / "out").exists()


def test_a_damaged_checkpoint_writes_nothing(tmp_path, capsys):
    template, stores = round0(tmp_path, "tiny")
    key = read_manifest(stores.global_, RUN, 0)[0].model.key
    path = tmp_path / "store" / "global" / key
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert main(["export", RUN, str(tmp_path / "out"), "--store", template]) == 1
    assert "does not match its manifest" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("out", ["a-file/model", "a-file", "missing-round"])
def test_an_out_it_cannot_write_or_a_round_that_is_not_there_is_refused(tmp_path, capsys, out):
    template, _ = round0(tmp_path, "tiny")
    (tmp_path / "a-file").write_text("")
    args = ["export", RUN, str(tmp_path / out), "--store", template]
    if out == "missing-round":
        args += ["--round", "7"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("islands: OUT: " if out != "missing-round" else "islands: --round 7")
    assert not (tmp_path / "missing-round").exists()


@pytest.mark.parametrize("where", ["global/runs/export-run", "global", "north/elsewhere", "link/runs"])
def test_an_out_inside_a_bucket_of_the_runs_store_is_refused_and_the_run_stays_readable(tmp_path, capsys, where):
    """OUT in the store would land on the run's create-only keys (its config.json): refused, exit 2,
    one line, nothing written; the run still reads (status, audit)."""
    template, stores = round0(tmp_path, "tiny")
    (tmp_path / "store" / "link").symlink_to(tmp_path / "store" / "global")  # the bucket by another name
    config = (tmp_path / "store" / "global" / layout.config_key(RUN)).read_bytes()
    capsys.readouterr()
    out = tmp_path / "store" / where
    assert main(["export", RUN, str(out), "--store", template, "--force"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    bucket = "north" if where.startswith("north") else "global"
    assert len(err) == 1 and err[0].startswith(f"islands: OUT: {out} is inside file://{tmp_path}/store/{bucket}")
    assert (tmp_path / "store" / "global" / layout.config_key(RUN)).read_bytes() == config
    assert not (tmp_path / "store" / "north").exists() and not (out / "model.safetensors").exists()
    assert main(["status", RUN, "--store", template]) == 0
    assert main(["audit", RUN, "--store", template]) == 0


def test_files_at_out_that_the_export_would_change_are_kept_unless_forced(tmp_path, capsys):
    """A file of OUT with other bytes stops the export before it writes; the same export again
    is a no-op; --force puts new files in their place and never writes through a link."""
    template, _ = round0(tmp_path, "tiny")
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("mine\n")
    (tmp_path / "kept.json").hardlink_to(out / "config.json")
    capsys.readouterr()
    assert main(["export", RUN, str(out), "--store", template]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"islands: OUT: {out} already holds config.json, with other bytes")
    assert sorted(p.name for p in out.iterdir()) == ["config.json"] and (out / "config.json").read_text() == "mine\n"
    assert main(["export", RUN, str(out), "--store", template, "--force"]) == 0
    assert '"model": "tiny"' in (out / "config.json").read_text() and (out / "model.safetensors").is_file()
    assert (tmp_path / "kept.json").read_text() == "mine\n"
    written = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main(["export", RUN, str(out), "--store", template]) == 0  # the same bytes: nothing to replace
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == written
