"""Bad data stops `islands run` and `islands prepare` before anything is written: one line naming
the field (or argument) and what to do, exit 2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tokenizers_for_tests import train_bpe

from islands.flows.cli import main
from islands.storage.prepare import groups, prepare
from islands.storage.tokenizer import load_tokenizer


@pytest.fixture
def stage(tmp_path, monkeypatch):
    """A folder store nothing may be written to, and a Prefect API that must not be needed."""
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    store = tmp_path / "store"
    return tmp_path, f"file://{store}/{{bucket}}", store


def refused(capsys, args: list[str], pattern: str) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.match(pattern, err[0]), err[0]


def run_args(store: str, *extra: str) -> list[str]:
    return ["run", "--run-id", "bad-data", "--regions", "north,south", "--store", store, *extra]


def test_a_corpus_url_matching_nothing(stage, capsys):
    tmp, store, folder = stage
    refused(capsys, run_args(store, "--corpus", f"file://{tmp}/none/*.jsonl"), r"islands: corpus: .* matches no files")
    refused(capsys, run_args(store, "--eval-corpus", f"{tmp}/none"), r"islands: eval_corpus: .* matches no files")
    assert not folder.exists()


def test_a_tokenizer_whose_vocabulary_does_not_fit_the_model(stage, capsys):
    tmp, store, folder = stage
    big = train_bpe(tmp / "big.json", 512)
    refused(
        capsys,
        run_args(store, "--tokenizer", str(big)),
        r"islands: tokenizer: .*big.json has 512 tokens, more than the model's vocabulary of 256",
    )
    refused(
        capsys,
        run_args(store, "--tokenizer", str(tmp / "nope.json")),
        r"islands: tokenizer: .*nope.json does not exist",
    )
    assert not folder.exists()


def test_a_shard_of_the_wrong_length(stage, capsys):
    tmp, store, folder = stage
    src = tmp / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"abc" * 30_000)
    (src / "b.txt").write_bytes(b"xyz" * 30_000)
    tok = load_tokenizer(None)
    prepare(groups(str(src), tok, 1), str(tmp / "ds"), tok, None, workers=1)
    shard = tmp / "ds" / "shard-000000.bin"
    shard.write_bytes(shard.read_bytes() + b"\0")
    refused(
        capsys,
        run_args(store, "--corpus", str(tmp / "ds")),
        r"islands: corpus: shard shard-000000.bin holds 180001 bytes, not the 90000 uint16 tokens",
    )
    assert not folder.exists()


def test_prepare_refuses_a_source_matching_nothing_and_a_missing_tokenizer(tmp_path, capsys):
    dst = tmp_path / "out"
    refused(capsys, ["prepare", str(tmp_path / "none" / "*.txt"), str(dst)], r"islands: SRC: .* matches no files")
    refused(
        capsys,
        ["prepare", "stdlib", str(dst), "--tokenizer", str(tmp_path / "t")],
        r"islands: --tokenizer: .* does not exist",
    )
    refused(capsys, ["prepare", "stdlib", str(dst), "--shard-mb", "0"], r"islands: --shard-mb 0: give the megabytes")
    assert not Path(dst).exists()
