"""Model and tokenizer folders load no code of their own and no pickles, refused before anything
starts; token shards keep the tokenizer they were made with, a run takes it from them, and an
export always holds the run's tokenizer (bytes included) as AutoTokenizer loads it."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_models import write_llama
from tokenizers_for_tests import sample_texts, train_bpe

from islands.core.config import RunConfig
from islands.core.model import ModelError, build_model, check_model, params_of
from islands.flows import commands
from islands.flows.cli import main
from islands.storage.shards import MANIFEST, Shards
from tests.test_export import driver, round0

TESTS = Path(__file__).parent
RUN = "models-run"

CODE = """
from pathlib import Path
Path({marker!r}).write_text("the folder's code ran")
"""


def evil_model(folder: Path, marker: Path) -> Path:
    """A model folder whose config asks transformers to import its own evil.py, which leaves `marker`."""
    folder.mkdir(parents=True)
    config = {
        "model_type": "evil-model",
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
        "vocab_size": 256,
        "max_position_embeddings": 64,
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(
        CODE.format(marker=str(marker))
        + "from transformers import PretrainedConfig\nclass EvilConfig(PretrainedConfig):\n    model_type = 'evil-model'\n"
    )
    return folder


def evil_tokenizer(folder: Path, marker: Path) -> Path:
    """A tokenizer folder whose tokenizer_config.json asks AutoTokenizer to import its evil.py."""
    folder.mkdir(parents=True)
    config = {"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(
        CODE.format(marker=str(marker))
        + "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    return folder


@pytest.fixture
def nothing_starts(monkeypatch):
    """`islands run` in this process, with every step that would start or write something failing the test."""
    for name in ("bring_up", "preflight", "wait_for_learner_deployment"):
        monkeypatch.setattr(commands, name, lambda *a, _name=name, **k: pytest.fail(f"{_name}() was reached"))
    monkeypatch.setattr("islands.flows.training_run.training_run", lambda *a, **k: pytest.fail("the run started"))
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))  # what a careless operator would answer


def one_line(stderr: str, starts: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(starts), lines
    return lines[0]


@pytest.mark.parametrize("stdin", ["closed", "y"])
def test_a_model_folder_that_asks_for_its_own_code_is_refused_without_a_prompt_or_running_it(tmp_path, stdin):
    marker = tmp_path / "ran"
    folder = evil_model(tmp_path / "evil", marker)
    store = tmp_path / "store"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "islands.flows.cli",
            "run",
            "--model",
            str(folder),
            "--store",
            f"file://{store}/{{bucket}}",
        ],
        stdin=subprocess.DEVNULL if stdin == "closed" else None,
        input="y\n" * 10 if stdin == "y" else None,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "[y/N]" not in done.stdout + done.stderr
    line = one_line(done.stderr, f"islands: model: {folder} ")
    assert "config.json" in line and "auto_map" in line
    assert not marker.exists() and not store.exists()


def test_auto_map_or_an_unknown_model_type_is_named_in_one_line(tmp_path):
    llama = write_llama(tmp_path / "llama")
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "x.Config"}}))
    with pytest.raises(ModelError, match=rf"^model: {llama} .*\(config.json: auto_map\)") as caught:
        check_model(str(llama))
    assert "\n" not in str(caught.value)
    (llama / "config.json").write_text(json.dumps({**config, "model_type": "no-such-architecture"}))
    with pytest.raises(ModelError, match=r"^model: .*\(config.json: model_type 'no-such-architecture'"):
        check_model(f"file://{llama}/config.json")


@pytest.mark.parametrize("command", ["prepare", "run", "export"])
def test_a_tokenizer_folder_that_asks_for_its_own_code_is_refused_before_anything_is_written(
    tmp_path, capsys, nothing_starts, command
):
    marker = tmp_path / "ran"
    folder = evil_tokenizer(tmp_path / "tok", marker)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(sample_texts(1)[0])
    out = tmp_path / "out"
    if command == "prepare":
        args = ["prepare", str(src), str(out), "--tokenizer", str(folder), "--workers", "1"]
    elif command == "run":
        args = ["run", "--corpus", str(src), "--tokenizer", str(folder), "--store", f"file://{out}/{{bucket}}"]
    else:
        template, _ = round0(tmp_path, "tiny", str(folder), run=RUN)
        args = ["export", RUN, str(out), "--store", template]
    assert main(args) == 2
    field = "--tokenizer" if command == "prepare" else "tokenizer"
    line = one_line(capsys.readouterr().err, f"islands: {field}: {folder} ")
    assert "tokenizer_config.json: auto_map" in line
    assert not marker.exists() and not out.exists()


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "model.pth", "last.ckpt", "weights.pkl"])
def test_pickle_weights_are_refused_before_the_stack_starts(tmp_path, capsys, nothing_starts, name):
    folder = write_llama(tmp_path / "llama")
    torch.save(params_of(build_model(str(folder), 0)), folder / name)
    store = tmp_path / "store"
    assert main(["run", "--model", str(folder), "--store", f"file://{store}/{{bucket}}", "--rounds", "1"]) == 2
    line = one_line(capsys.readouterr().err, f"islands: model: {folder} ")
    assert name in line and "pickle" in line
    assert not store.exists()


def test_pickles_beside_safetensors_are_left_alone_and_the_safetensors_loaded(tmp_path):
    folder = write_llama(tmp_path / "llama")
    trained = build_model(str(folder), 3)
    trained.save_pretrained(folder)
    torch.save({"lr": 1.0}, folder / "training_args.bin")
    check_model(str(folder))
    loaded = params_of(build_model(str(folder), 0))
    assert all(torch.equal(loaded[k], v) for k, v in params_of(trained).items())


@pytest.fixture
def shards(tmp_path) -> tuple[Path, Path, str]:
    """(token shards `islands prepare` made of one document with a 250-token BPE tokenizer whose
    file is then gone, that document, the tokenizer's sha256)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(sample_texts(1)[0])
    tok = train_bpe(tmp_path / "tokenizer.json", 250)
    assert main(["prepare", str(src), str(tmp_path / "ds"), "--tokenizer", str(tok), "--workers", "1"]) == 0
    dataset = json.loads((tmp_path / "ds" / MANIFEST).read_text())
    copy = tmp_path / "ds" / "tokenizer" / "tokenizer.json"
    assert copy.read_bytes() == tok.read_bytes() and dataset["tokenizer"]["files"] == {
        "tokenizer.json": dataset["tokenizer"]["sha256"]
    }
    tok.unlink()
    return tmp_path / "ds", src / "a.txt", dataset["tokenizer"]["sha256"]


def exported_encodes_as_the_shards(out: Path, ds: Path, doc: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    held = Shards(str(ds / MANIFEST))
    ids = tok(doc.read_text()).input_ids + [tok.eos_token_id]
    assert len(ids) < len(doc.read_text()) and np.array_equal(held.read(0, 0, held.lengths[0]), ids)


def test_a_run_on_shards_takes_their_tokenizer_and_its_export_encodes_as_they_do(tmp_path, capsys, monkeypatch, shards):
    ds, doc, sha = shards
    ran: list[RunConfig] = []

    def training_run(config, chaos=None):
        ran.append(config)
        driver(config)
        return {"run_id": config.run_id}

    monkeypatch.setattr(commands, "on_embedded_prefect", lambda: False)
    monkeypatch.setattr(commands, "wait_for_learner_deployment", lambda name: None)
    monkeypatch.setattr("islands.flows.training_run.training_run", training_run)
    monkeypatch.delenv("ISLANDS_UI_URL", raising=False)
    template = f"file://{tmp_path}/store/{{bucket}}"
    args = ["run", "--run-id", RUN, "--regions", "north", "--corpus", str(ds), "--store", template, "--rounds", "1"]
    assert main([*args, "--quorum.min-quorum", "1", "--eval-every", "0"]) == 0
    assert [c.tokenizer for c in ran] == [f"{ds}/tokenizer"]
    assert main(["export", RUN, str(tmp_path / "out"), "--store", template]) == 0
    assert "tokenizer.json" in capsys.readouterr().out
    exported_encodes_as_the_shards(tmp_path / "out", ds, doc)


def test_a_named_tokenizer_other_than_the_shards_is_refused_before_anything_starts(
    tmp_path, capsys, nothing_starts, shards
):
    ds, _, _ = shards
    other = train_bpe(tmp_path / "other.json", 200)
    template = f"file://{tmp_path}/store/{{bucket}}"
    assert main(["run", "--corpus", str(ds), "--tokenizer", str(other), "--store", template]) == 2
    one_line(capsys.readouterr().err, f"islands: tokenizer: {other} is not the tokenizer {ds} was made with")
    assert not (tmp_path / "store").exists()


def test_a_run_that_named_no_tokenizer_on_shards_exports_theirs(tmp_path, shards):
    """A run started without the CLI's checks (a deployment's) still exports the shards' tokenizer."""
    ds, doc, _ = shards
    template, _ = round0(tmp_path, "tiny", corpus=str(ds), run=RUN)
    assert main(["export", RUN, str(tmp_path / "out"), "--store", template]) == 0
    exported_encodes_as_the_shards(tmp_path / "out", ds, doc)


@pytest.mark.parametrize("model", ["tiny", "llama with a tokenizer of its own"])
def test_a_byte_level_runs_export_loads_in_autotokenizer_as_the_bytes_it_trained_on(tmp_path, model):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if model != "tiny":
        folder = write_llama(tmp_path / "llama")
        bpe = train_bpe(tmp_path / "bpe.json", 250)
        PreTrainedTokenizerFast(tokenizer_file=str(bpe), eos_token="<|endoftext|>").save_pretrained(folder)
        model = str(folder)
    template, _ = round0(tmp_path, model, run=RUN)
    assert main(["export", RUN, str(tmp_path / "out"), "--store", template]) == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "def main():\n    return 'héllo ✓'\n\n\x00\x7f"
    ids = tok(text).input_ids
    assert ids == list(text.encode()) and len(tok) == 256
    assert tok.decode(ids) == text
