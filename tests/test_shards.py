"""Token shards on disk: `prepare` writes them with their manifest from .txt, .jsonl and .parquet
text, skips what is already there, and opening them checks every shard's size; a learner's
stream reads them by ranges and names the shard and offset of an id the model cannot embed."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers_for_tests import sample_texts, train_bpe

from islands.core.data import BatchSampler, Segment, Stream, TokenRangeError, assign
from islands.storage.corpus import check_corpus, held_out_part, open_corpus, training_part
from islands.storage.prepare import groups, prepare
from islands.storage.shards import MANIFEST, Shards
from islands.storage.text import CorpusError
from islands.storage.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """Six documents as .txt, .jsonl and .parquet files, and a 250-token BPE tokenizer."""
    root = tmp_path_factory.mktemp("texts")
    docs = sample_texts()
    (root / "src").mkdir()
    (root / "src" / "a.txt").write_text(docs[0])
    (root / "src" / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[1:4]))
    pq.write_table(pa.table({"text": docs[4:]}), root / "src" / "c.parquet")
    return root, docs, train_bpe(root / "tokenizer.json", 250)


def make(src, dst, tokenizer_path, shard_bytes=1):
    tokenizer = load_tokenizer(tokenizer_path)
    return prepare(groups(str(src), tokenizer, shard_bytes), str(dst), tokenizer, tokenizer_path, workers=1)


def test_prepare_writes_one_shard_per_file_group_that_reads_back_as_the_tokenizer_encodes(texts, tmp_path):
    root, docs, tok_path = texts
    dataset, made = make(root / "src", tmp_path / "ds", str(tok_path))
    assert made == 3 and [s.name for s in dataset.shards] == [f"shard-{i:06d}.bin" for i in range(3)]
    assert dataset.dtype == "uint16" and dataset.tokenizer.vocab_size == 250
    tok = load_tokenizer(str(tok_path))
    assert dataset.tokenizer.sha256 == tok.sha256
    shards = Shards(str(tmp_path / "ds" / MANIFEST))
    for i, group in enumerate([docs[:1], docs[1:4], docs[4:]]):
        expected = tok.encode([d.encode() for d in group])
        assert shards.lengths[i] == len(expected) and expected[-1] == tok.eos
        assert np.array_equal(shards.read(i, 0, len(expected)), expected)
        assert np.array_equal(shards.read(i, 5, 105), expected[5:105])  # a ranged read
    # The folder names the dataset as well as its manifest; text tokenized at the start agrees.
    assert open_corpus(str(tmp_path / "ds")).lengths == shards.lengths
    in_memory = open_corpus(str(root / "src"), tok)
    assert in_memory.lengths == [sum(shards.lengths)]


def test_prepare_again_skips_the_shards_already_there_and_remakes_a_changed_one(texts, tmp_path):
    root, docs, tok_path = texts
    src = tmp_path / "src"
    src.mkdir()
    for i, d in enumerate(docs[:3]):
        (src / f"{i}.txt").write_text(d)
    first, made = make(src, tmp_path / "ds", None)
    assert made == 3 and first.dtype == "uint16" and first.tokenizer.name == "bytes"
    again, made = make(src, tmp_path / "ds", None)
    assert made == 0 and again == first
    (src / "1.txt").write_text(docs[1] + "\n# changed\n")
    changed, made = make(src, tmp_path / "ds", None)
    assert made == 1 and changed.shards[0] == first.shards[0] and changed.shards[1] != first.shards[1]


def test_a_shard_of_the_wrong_length_or_dtype_is_named_when_the_dataset_opens(texts, tmp_path):
    root, docs, _ = texts
    make(root / "src", tmp_path / "ds", None)
    shard = tmp_path / "ds" / "shard-000001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(
        CorpusError, match=r"^corpus: shard shard-000001.bin holds \d+ bytes, not the \d+ uint16 tokens"
    ):
        Shards(str(tmp_path / "ds" / MANIFEST))
    manifest = json.loads((tmp_path / "ds" / MANIFEST).read_text())
    manifest["dtype"] = "uint32"
    (tmp_path / "ds" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CorpusError, match=r"^corpus: shard shard-000000.bin holds \d+ bytes, not the \d+ uint32"):
        Shards(str(tmp_path / "ds" / MANIFEST))


@pytest.mark.parametrize(
    ("field", "value", "refusal"),
    [
        ("name", "../../../etc/passwd", "shards.1.name: Value error, '../../../etc/passwd' is not a file inside"),
        ("name", "/etc/passwd", "shards.1.name: Value error, '/etc/passwd' is not a file inside the dataset's folder"),
        ("name", "s3://other/shard.bin", "shards.1.name: Value error, 's3://other/shard.bin' is not a file inside"),
        ("name", "shard-000000.bin", "the manifest: Value error, shard 'shard-000000.bin' is listed twice"),
        ("tokens", -4, "shards.1.tokens: Input should be greater than or equal to 0"),
        ("vocab_size", -1, "tokenizer.vocab_size: Input should be greater than or equal to 1"),
        ("vocab_size", 70_000, "the manifest: Value error, uint16 shards cannot hold the ids of a vocabulary of 70000"),
    ],
)
def test_a_dataset_json_entry_that_leads_out_of_its_folder_or_is_out_of_bounds_is_named(
    texts, tmp_path, field, value, refusal
):
    """A name from a data file resolves inside its folder or is refused, before anything is read
    at it; each field is checked against its bounds. One line naming the file and the entry."""
    root, _, _ = texts
    make(root / "src", tmp_path / "ds", None)
    path = tmp_path / "ds" / MANIFEST
    manifest = json.loads(path.read_text())
    if field == "vocab_size":
        manifest["tokenizer"]["vocab_size"] = value
    else:
        manifest["shards"][1][field] = value
    path.write_text(json.dumps(manifest))
    with pytest.raises(CorpusError) as refused:
        check_corpus(str(tmp_path / "ds"), None, None, 256)
    assert str(refused.value).startswith(f"corpus: {path} is not a dataset manifest ({refusal}")
    assert "\n" not in str(refused.value)


def test_the_corpus_and_tokenizer_are_checked_against_the_model_before_a_run(texts, tmp_path):
    root, _, tok_path = texts
    big = train_bpe(tmp_path / "big.json", 512)
    with pytest.raises(
        CorpusError, match=r"^tokenizer: .*big.json has 512 tokens, more than the model's vocabulary of 256"
    ):
        check_corpus(str(root / "src"), None, str(big), 256)
    with pytest.raises(CorpusError, match=r"^corpus: .*nothing-here/\*.txt' matches no files"):
        check_corpus(f"file://{tmp_path}/nothing-here/*.txt", None, None, 256)
    with pytest.raises(CorpusError, match=r"^eval_corpus: .*missing' matches no files"):
        check_corpus("stdlib", str(tmp_path / "missing"), None, 256)
    make(root / "src", tmp_path / "ds512", str(big))
    with pytest.raises(
        CorpusError, match=r"^corpus: .*ds512 was tokenized with 512 tokens .* model's vocabulary of 256"
    ):
        check_corpus(str(tmp_path / "ds512"), None, None, 256)
    with pytest.raises(CorpusError, match=r"^tokenizer: .* is not the tokenizer .*ds512 was made with"):
        check_corpus(str(tmp_path / "ds512"), None, str(tok_path), 1024)
    check_corpus(str(tmp_path / "ds512"), None, None, 512)


def test_learners_stream_disjoint_parts_and_the_held_out_split_is_the_last_shard(texts, tmp_path):
    root, _, tok_path = texts
    make(root / "src", tmp_path / "ds", str(tok_path))
    reader, train = training_part(str(tmp_path / "ds"))
    held_reader, held = held_out_part(str(tmp_path / "ds"))
    assert train == [Segment(0, 0, reader.lengths[0]), Segment(1, 0, reader.lengths[1])]
    assert held == [Segment(2, 0, reader.lengths[2])]
    parts = [assign(train, i, 2, block_size=16) for i in range(2)]
    assert sum(s.tokens for p in parts for s in p) == reader.lengths[0] + reader.lengths[1]
    sampler = BatchSampler(Stream(reader, parts[1], 17, vocab_size=250), 4, 16, seed=0)
    x, y = sampler.next_batch()
    assert x.shape == (4, 16) and int(x.max()) < 250
    # eval_corpus names the held-out split: the corpus is then all training data.
    assert training_part(str(tmp_path / "ds"), str(tmp_path / "ds"))[1][-1] == Segment(2, 0, reader.lengths[2])


def test_an_id_at_or_above_the_models_vocabulary_fails_the_read_naming_the_shard_and_offset(texts, tmp_path):
    root, _, tok_path = texts
    make(root / "src", tmp_path / "ds", str(tok_path))
    reader = Shards(str(tmp_path / "ds" / MANIFEST))
    stream = Stream(reader, [Segment(1, 0, reader.lengths[1])], 17, vocab_size=200)  # a model of 200 ids
    with pytest.raises(TokenRangeError, match=r"^corpus: shard shard-000001.bin holds token id 2\d\d at offset \d+"):
        stream.current()


def test_prepare_refuses_a_dst_inside_a_runs_bucket_or_over_files_it_did_not_write(texts, tmp_path, capsys):
    """No command's output lands on a run's keys: a DST inside any bucket of the store (--store, or
    the embedded one's) is refused before anything is read or written. Files prepare would replace
    that it did not write stop it too, unless --force; its own are no obstacle."""
    from islands.flows.cli import main

    root, _, tok_path = texts
    src = str(root / "src" / "a.txt")
    store = f"file://{tmp_path}/store/{{bucket}}"

    def refused(args: list[str]) -> str:
        assert main(["prepare", src, *args, "--workers", "1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        return err[0]

    inside = tmp_path / "store" / "east" / "runs" / "r1"
    assert refused([str(inside), "--store", store, "--force"]).startswith(
        f"islands: DST: {inside} is inside file://{tmp_path}/store/east, a bucket of the store"
    )
    assert not (tmp_path / "store").exists()
    assert refused(["s3://islands-global/corpus"]).startswith(
        "islands: DST: s3://islands-global/corpus is inside s3://islands-global, a bucket of the store s3://islands-{bucket}"
    )
    dst = tmp_path / "ds"
    dst.mkdir()
    (dst / MANIFEST).write_text('{"mine": true}')
    assert refused([str(dst)]) == (
        f"islands: DST: {dst} holds {MANIFEST}, which islands prepare did not write; nothing written: "
        "give an empty folder, or --force to replace them"
    )
    assert sorted(p.name for p in dst.iterdir()) == [MANIFEST]
    assert main(["prepare", src, str(dst), "--workers", "1", "--force"]) == 0
    assert main(["prepare", src, str(dst), "--workers", "1"]) == 0  # its own files: made again or kept
    assert Shards(str(dst / MANIFEST)).names == ["shard-000000.bin"]
    with_tokenizer = tmp_path / "tok-ds"  # the tokenizer's copy beside the shards is checked too
    (with_tokenizer / "tokenizer").mkdir(parents=True)
    (with_tokenizer / "tokenizer" / "tokenizer.json").write_text("{}")
    assert refused([str(with_tokenizer), "--tokenizer", str(tok_path)]).startswith(
        f"islands: DST: {with_tokenizer} holds tokenizer/tokenizer.json, which islands prepare did not write"
    )
    assert (with_tokenizer / "tokenizer" / "tokenizer.json").read_text() == "{}"
    for force in (["--force"], []):
        assert main(["prepare", src, str(with_tokenizer), "--tokenizer", str(tok_path), "--workers", "1", *force]) == 0
