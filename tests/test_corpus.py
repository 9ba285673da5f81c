import sysconfig
from pathlib import Path

import pytest

from islands.storage.text import SKIPPED_DIRS, CorpusError, read_corpus, stdlib_files


def test_stdlib_files_prune_test_suites_and_installed_packages(tmp_path):
    for rel in [
        "a.py",
        "pkg/b.py",
        "pkg/tests/c.py",
        "test/d.py",
        "site-packages/x/e.py",
        "idle_test/f.py",
        "pkg/notes.txt",
        "pkg/__pycache__/b.cpython-311.pyc",
    ]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    assert stdlib_files(tmp_path) == [tmp_path / "a.py", tmp_path / "pkg" / "b.py"]


def test_the_interpreters_stdlib_is_listed_in_order_without_skipped_folders():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    assert files == sorted(files)
    assert {root / "pydoc_data" / "topics.py", root / "json" / "decoder.py"} <= set(files)
    assert not any(SKIPPED_DIRS.intersection(p.relative_to(root).parts) for p in files)


def test_a_file_glob_is_read_in_path_order_and_joined(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"B" * 40_000)
    (tmp_path / "a.txt").write_bytes(b"A" * 40_000)
    data = read_corpus(f"file://{tmp_path}/*.txt")
    assert data == b"A" * 40_000 + b"\n\n" + b"B" * 40_000


def test_too_little_text_is_refused_saying_how_much_was_found(tmp_path):
    (tmp_path / "small.txt").write_bytes(b"x" * 100)
    with pytest.raises(CorpusError, match=r"100 bytes in 1 files; need at least 65536"):
        read_corpus(f"file://{tmp_path}/*.txt")
    with pytest.raises(CorpusError, match=r"^corpus: .*missing/\*.txt' matches no files"):
        read_corpus(f"file://{Path(tmp_path, 'missing')}/*.txt")


def test_invalid_utf8_in_json_lines_is_one_line_naming_the_file_and_byte_and_prepare_leaves_no_folder(tmp_path, capsys):
    from islands.flows.cli import main

    src = tmp_path / "bad.jsonl"
    src.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')  # Latin-1, not UTF-8: byte 17 + 13
    with pytest.raises(CorpusError, match=r"bad.jsonl: invalid UTF-8 at byte 30 \(line 2\)"):
        read_corpus(str(src), min_bytes=1)
    out = tmp_path / "made" / "shards"
    assert main(["prepare", str(src), str(out), "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"islands: file://{src}: invalid UTF-8 at byte 30 (line 2); JSON Lines must be UTF-8"]
    assert not (tmp_path / "made").exists()
    src.write_bytes(b'{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(CorpusError, match=r'bad.jsonl: line 2 \(byte 17\) is not a JSON object with a "text" string'):
        read_corpus(str(src), min_bytes=1)
