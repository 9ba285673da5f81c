"""Names that come from outside a run cannot lead its commands elsewhere: a run id given on the
command line is a run's name, never a path out of the store, and a store template whose buckets
are one place is refused before anything starts or is written."""

from __future__ import annotations

from pathlib import Path

import pytest

import islands.flows.commands as commands
from islands.core.config import RunConfig
from islands.flows.cli import main


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.fixture
def no_stack(monkeypatch):
    """Any command that would bring up the embedded stack fails the test instead."""

    def refuse(*_, **__):
        raise AssertionError("the stack was brought up")

    monkeypatch.setattr(commands, "bring_up", refuse)
    monkeypatch.setattr("islands.flows.bring_up.bring_up", refuse)


@pytest.mark.parametrize("command", ["status", "audit", "resume", "export"])
@pytest.mark.parametrize("run_id", ["../../../outside", "/etc", "Run-1", "a"])
def test_a_run_id_that_is_not_a_run_name_is_refused_before_anything_is_read(
    tmp_path, capsys, no_stack, command, run_id
):
    template = f"file://{tmp_path}/store/{{bucket}}"
    outside = tmp_path / "outside"  # where runs/../../../outside leads from the global bucket
    outside.mkdir()
    (outside / "config.json").write_text(RunConfig(run_id="outside", store=template).model_dump_json())
    args = [command, run_id, *([str(tmp_path / "out")] if command == "export" else []), "--store", template]
    assert main(args) == 2
    assert one_error(capsys).startswith(f"islands: {run_id!r} is not a run id; a run id has 3–42 characters")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "template",
    ["{tmp}/x/{{bucket}}/..", "file://{tmp}/x/{{bucket}}/../y", "file://{tmp}/x/{{bucket}}/./.."],
)
def test_a_store_template_whose_dots_take_the_bucket_away_is_refused_before_the_run_starts(
    tmp_path, capsys, no_stack, template
):
    store = template.format(tmp=tmp_path)
    assert main(["run", "--regions", "north,south", "--rounds", "1", "--store", store]) == 2
    line = one_error(capsys)
    assert line.startswith(f"islands: store {store!r}: the bucket name is taken away by '..'")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    for command in ("status", "audit"):
        assert main([command, "run-1", "--store", store]) == 2
        assert "the bucket name is taken away" in one_error(capsys)


def test_regions_whose_buckets_are_one_folder_through_a_link_are_refused(tmp_path, capsys, no_stack):
    (tmp_path / "store" / "global").mkdir(parents=True)
    (tmp_path / "store" / "north").symlink_to(tmp_path / "store" / "global")
    store = f"file://{tmp_path}/store/{{bucket}}"
    assert main(["run", "--regions", "north,south", "--rounds", "1", "--store", store]) == 2
    assert "the buckets 'global' and 'north' are one location" in one_error(capsys)
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["global", "north"]


def test_a_config_json_that_is_not_a_runs_config_is_one_line_not_a_traceback(tmp_path, capsys, no_stack):
    template = f"file://{tmp_path}/store/{{bucket}}"
    folder = Path(tmp_path / "store" / "global" / "runs" / "run-1")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"rounds": "many"}')
    for command in ("status", "audit", "resume"):
        assert main([command, "run-1", "--store", template]) == 2
        line = one_error(capsys)
        assert "runs/run-1/config.json is not a run config islands wrote (rounds:" in line
