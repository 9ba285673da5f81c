"""Run configuration: defaults, derived values, and every bad configuration refused with one clear
line and exit status 2 before anything is written."""

import argparse
import math
import socket
import typing
import uuid
from pathlib import Path

import boto3
import pytest
import s3fs
from pydantic import BaseModel, Field, ValidationError

from islands.core.config import (
    ConfigError,
    QuorumSettings,
    RunConfig,
    load_config,
)
from islands.flows import cli, commands, run_flags
from islands.flows.run_flags import overrides

# -- the model itself -----------------------------------------------------------------------------


def test_defaults_validate():
    cfg = RunConfig()
    assert RunConfig.model_validate(cfg.model_dump()) == cfg
    assert cfg.regions == ["us-east", "eu-west", "ap-south", "sa-east"]
    assert cfg.num_learners == 4
    assert cfg.max_quorum == 4
    assert cfg.quorum.min_quorum <= cfg.num_learners
    assert load_config(None, {}) == cfg


def test_learners_order_and_names():
    cfg = RunConfig(regions=["us-east", "eu-west", "ap-south"], learners_per_region=2, speed={})
    assert cfg.learners() == [
        ("us-east-0", "us-east", 0),
        ("eu-west-0", "eu-west", 1),
        ("ap-south-0", "ap-south", 2),
        ("us-east-1", "us-east", 3),
        ("eu-west-1", "eu-west", 4),
        ("ap-south-1", "ap-south", 5),
    ]
    assert cfg.num_learners == 6
    assert cfg.max_quorum == 6


def test_threads_per_learner(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert RunConfig().threads_per_learner() == 4
    assert RunConfig(learners_per_region=8).threads_per_learner() == 1  # 32 learners share 16 cores
    assert RunConfig(torch_threads=3).threads_per_learner() == 3
    monkeypatch.setattr("os.cpu_count", lambda: None)
    assert RunConfig().threads_per_learner() == 1


def test_slowdown():
    cfg = RunConfig(speed={"eu-west": 0.25, "us-east": 1.0})
    assert cfg.slowdown("eu-west") == 4.0
    assert cfg.slowdown("us-east") == 1.0
    assert cfg.slowdown("ap-south") == 1.0
    assert RunConfig().slowdown("eu-west") == pytest.approx(1 / 0.33)


def test_step_floor_names_known_regions_and_seconds():
    assert RunConfig(min_step_s={"eu-west": 0.5}).min_step_s == {"eu-west": 0.5}
    with pytest.raises(ValidationError, match="min_step_s: unknown region 'mars'"):
        RunConfig(min_step_s={"mars": 0.5})
    with pytest.raises(ValidationError, match="must be seconds in \\[0, 3600\\]"):
        RunConfig(min_step_s={"eu-west": -1.0})


def test_a_run_ends_at_its_last_round_its_target_loss_or_its_token_budget():
    plain = RunConfig(rounds=5)
    assert plain.ended_by(4, 0.1, 10**9) is None  # neither set: a low loss or many tokens end nothing
    assert plain.ended_by(5, 9.0, 0) == "all 5 rounds published"
    target = RunConfig(rounds=5, target_loss=2.5)
    assert target.ended_by(3, 2.51, 0) is None
    assert target.ended_by(3, 2.5, 0) == "round 3 reached the target eval loss 2.5 (2.5000)"
    assert target.ended_by(5, 3.0, 0) == "all 5 rounds published"
    budget = RunConfig(rounds=5, token_budget=1000)
    assert budget.ended_by(2, 1.0, 999) is None
    assert budget.ended_by(2, 1.0, 1000) == "round 2 merged the token budget of 1,000 (1,000)"
    assert plain.end_rule() == "5 rounds"
    assert (
        RunConfig(rounds=5, target_loss=2.5, token_budget=10**6).end_rule()
        == "5 rounds or eval loss 2.5 or 1,000,000 tokens merged"
    )
    for field in ("target_loss", "token_budget"):
        with pytest.raises(ValidationError, match=field):
            RunConfig(**{field: 0})


def test_rounds_evaluated_are_every_nth_and_the_one_that_ends_the_run():
    every3 = RunConfig(rounds=10, eval_every=3, token_budget=1000)
    assert [r for r in range(11) if every3.evaluates(r, 0)] == [0, 3, 6, 9, 10]
    assert every3.evaluates(4, 1000)  # the round that merges the budget is the run's result
    last_only = RunConfig(rounds=10, eval_every=0)
    assert [r for r in range(11) if last_only.evaluates(r, 0)] == [10]
    assert all(RunConfig(rounds=10).evaluates(r, 0) for r in range(11))  # the default: every round
    with pytest.raises(ValidationError, match="eval_every: 0 evaluates the last round only"):
        RunConfig(eval_every=0, target_loss=2.5)
    with pytest.raises(ValidationError, match="eval_every"):
        RunConfig(eval_every=-1)


def test_load_config_file_with_nested_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'rounds = 3\ncodec = "bf16"\n[quorum]\ngrace_max_s = 2.5\nmin_quorum = 1\n[merge]\nouter_lr = 0.3\n'
    )
    cfg = load_config(path, {"quorum.min_quorum": 3, "rounds": 5, "inner.lr": 0.002})
    assert cfg.rounds == 5
    assert cfg.codec == "bf16"
    assert cfg.quorum.min_quorum == 3
    assert cfg.quorum.grace_max_s == 2.5  # the file's other fields of the section stay
    assert cfg.merge.outer_lr == 0.3
    assert cfg.inner.lr == 0.002
    assert cfg.inner.batch_size == RunConfig().inner.batch_size


def test_load_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"^quorum\.min_quorum: "):
        load_config(None, {"quorum.min_quorum": 0})
    with pytest.raises(ConfigError, match=r"quorum\.max_quorum: must lie between"):
        load_config(None, {"quorum.min_quorum": 3, "quorum.max_quorum": 2})
    with pytest.raises(ConfigError, match=r"^--config: .*nope\.toml does not exist"):
        load_config(tmp_path / "nope.toml", {})
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = = 3\n")
    with pytest.raises(ConfigError, match=r"^--config: .*bad\.toml is not valid TOML"):
        load_config(bad, {})
    with pytest.raises(ConfigError, match=r"^run_id: "):
        load_config(None, {"run_id": "Has Spaces"})
    with pytest.raises(ConfigError, match=r"^regions: .*global"):
        load_config(None, {"regions": ["us-east", "global"], "speed": {}})
    with pytest.raises(ConfigError, match=r"speed: .*must be in \(0, 1\]"):
        load_config(None, {"speed": {"eu-west": 0.0}})


def test_cli_overrides_map_flags_to_fields():
    args = cli.parser().parse_args(
        [
            "run",
            "--quorum.min-quorum",
            "2",
            "--inner-steps",
            "7",
            "--speed",
            "us-east=0.5",
            "--speed",
            "eu-west=1",
            "--codec",
            "bf16",
            "--target-loss",
            "2.4",
            "--token-budget",
            "5000",
            "--eval-every",
            "0",
            "--no-carry",
            "--inner.lr",
            "3e-4",
        ]
    )
    assert overrides(args) == {
        "quorum.min_quorum": 2,
        "inner_steps": 7,
        "codec": "bf16",
        "target_loss": 2.4,
        "token_budget": 5000,
        "eval_every": 0,
        "speed": {"us-east": 0.5, "eu-west": 1.0},
        "carry": False,
        "inner.lr": 3e-4,
    }
    # other regions without --speed: the demo's eu-west slowdown no longer applies
    args = cli.parser().parse_args(["run", "--regions", "a-1, b-2"])
    assert overrides(args) == {"regions": ["a-1", "b-2"]}
    config = load_config(None, overrides(args))
    assert config.regions == ["a-1", "b-2"] and config.speed == {}
    assert load_config(None, {"regions": ["eu-west", "x-1"]}).speed == {"eu-west": 0.33}


def test_every_setting_has_one_flag_spelled_as_its_key():
    sub = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {o for action in sub.choices["run"]._actions for o in action.option_strings}
    sections = {k: f.annotation for k, f in RunConfig.model_fields.items() if isinstance(f.annotation, type)}
    sections = {k: model for k, model in sections.items() if issubclass(model, BaseModel)}
    assert {"inner", "merge", "quorum"} <= sections.keys()
    keys = [k for k in RunConfig.model_fields if k not in sections]
    keys += [f"{s}.{k}" for s, model in sections.items() for k in model.model_fields]
    assert [p for p, _ in run_flags.fields()] == keys
    for key in keys:
        assert "--" + key.replace("_", "-") in flags, key


def test_a_new_field_of_a_copy_of_runconfig_gets_its_flag():
    """A setting is one line: a field added to RunConfig (or a section) is a flag with its help."""

    class Quorum(QuorumSettings):
        patience_s: float = Field(3.0, ge=0, description="How long to be patient.")

    class Config(RunConfig):
        shiny_new: int = Field(5, ge=1, description="A brand-new setting.")
        tags: dict[str, float] = Field({}, description="Per-region numbers.")
        quorum: Quorum = Quorum()

    p = argparse.ArgumentParser()
    run_flags.add_run_flags(p, Config)
    assert "A brand-new setting." in p.format_help() and "How long to be patient." in p.format_help()
    args = p.parse_args(["--shiny-new", "9", "--quorum.patience-s", "1.5", "--tags", "a-1=2", "--inner-steps", "3"])
    assert run_flags.overrides(args, Config) == {
        "shiny_new": 9,
        "quorum.patience_s": 1.5,
        "tags": {"a-1": 2.0},
        "inner_steps": 3,
    }
    assert run_flags.overrides(p.parse_args([]), Config) == {}


# -- the command line refuses bad configurations ---------------------------------------------------


@pytest.fixture
def cli_env(tmp_path, monkeypatch):
    """An empty working folder and ISLANDS_HOME; the embedded stack must never start."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("ISLANDS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")

    def no_stack(*args, **kwargs):
        raise AssertionError("the embedded stack must not start for this command")

    def no_deployment(*args, **kwargs):
        raise AssertionError("preflight should have refused the store before waiting for learners")

    monkeypatch.setattr(commands, "bring_up", no_stack)
    monkeypatch.setattr(commands, "wait_for_learner_deployment", no_deployment)
    return tmp_path


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def refused(argv: list[str], capsys, root: Path, monkeypatch=None) -> str:
    """Run the CLI, expect exit status 2 and exactly one error line, and nothing written."""
    before = files_under(root)
    if monkeypatch is not None:
        monkeypatch.setattr(commands, "execute", lambda *a, **k: pytest.fail("a bad config reached execute()"))
    code = cli.main(argv)
    err = capsys.readouterr().err
    # the in-process S3 server's request log may share stderr; the CLI's own lines start with "islands:"
    lines = [line for line in err.splitlines() if line.startswith("islands")]
    assert code == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("islands: ")
    assert files_under(root) == before
    assert not (root / "home").exists()
    assert not (root / "work" / ".islands").exists()
    return lines[0]


def test_min_quorum_above_learners(cli_env, capsys, monkeypatch):
    line = refused(["run", "--quorum.min-quorum", "9"], capsys, cli_env, monkeypatch)
    assert "quorum.min_quorum" in line
    assert "9 is more than the 4 learners" in line


def test_zero_inner_steps(cli_env, capsys, monkeypatch):
    line = refused(["run", "--inner-steps", "0"], capsys, cli_env, monkeypatch)
    assert "inner_steps" in line
    assert "positive" in line


def test_speed_of_unknown_region(cli_env, capsys, monkeypatch):
    line = refused(["run", "--speed", "mars=0.5"], capsys, cli_env, monkeypatch)
    assert "speed: unknown region 'mars'" in line
    assert "us-east" in line  # says which regions exist


def test_speed_that_is_not_a_number(cli_env, capsys, monkeypatch):
    monkeypatch.setattr(commands, "execute", lambda *a, **k: pytest.fail("a bad config reached execute()"))
    before = files_under(cli_env)
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--speed", "eu-west=abc"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--speed: takes KEY=NUMBER" in err
    assert "'eu-west=abc'" in err
    assert files_under(cli_env) == before


def test_toml_with_an_unknown_field(cli_env, capsys, monkeypatch):
    path = cli_env / "work" / "run.toml"
    path.write_text("rounds = 2\n[merge]\nouter_lrr = 0.3\n")
    line = refused(["run", "--config", str(path)], capsys, cli_env, monkeypatch)
    assert "merge.outer_lrr" in line
    assert "unknown field" in line


def test_toml_with_a_wrong_type(cli_env, capsys, monkeypatch):
    path = cli_env / "work" / "run.toml"
    path.write_text('rounds = "many"\n')
    line = refused(["run", "--config", str(path)], capsys, cli_env, monkeypatch)
    assert line.startswith("islands: rounds: ")
    assert "integer" in line


def test_store_without_bucket_placeholder(cli_env, capsys, monkeypatch):
    target = cli_env / "x"
    line = refused(["run", "--store", f"file://{target}"], capsys, cli_env, monkeypatch)
    assert line.startswith("islands: store: ")
    assert "{bucket}" in line
    assert not target.exists()


def test_missing_config_file_with_regions(cli_env, capsys, monkeypatch):
    line = refused(["run", "--config", "missing.toml", "--regions", "us-east,eu-west"], capsys, cli_env, monkeypatch)
    assert "--config" in line and "missing.toml" in line


def test_config_that_is_a_folder(cli_env, capsys, monkeypatch):
    folder = cli_env / "work" / "conf"
    folder.mkdir()
    line = refused(["run", "--config", str(folder)], capsys, cli_env, monkeypatch)
    assert "--config" in line


def test_section_given_as_scalar_with_an_override(cli_env, capsys, monkeypatch):
    path = cli_env / "work" / "run.toml"
    path.write_text("quorum = 3\n")
    line = refused(["run", "--config", str(path), "--quorum.min-quorum", "2"], capsys, cli_env, monkeypatch)
    assert "quorum" in line


def test_section_given_as_scalar(cli_env, capsys, monkeypatch):
    path = cli_env / "work" / "run.toml"
    path.write_text("quorum = 3\n")
    line = refused(["run", "--config", str(path)], capsys, cli_env, monkeypatch)
    assert line.startswith("islands: quorum: ")


# -- unusable storage is refused before anything is written ---------------------------------------


@pytest.fixture
def fresh_s3fs():
    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()


def test_missing_bucket_exits_2_naming_it(s3_endpoint, cli_env, capsys, fresh_s3fs):
    prefix = f"nope-{uuid.uuid4().hex[:8]}"
    line = refused(["run", "--store", f"s3://{prefix}-{{bucket}}", "--rounds", "1"], capsys, cli_env)
    assert f"s3://{prefix}-global" in line
    assert "does not exist" in line
    buckets = {b["Name"] for b in boto3.client("s3", endpoint_url=s3_endpoint).list_buckets()["Buckets"]}
    assert not any(name.startswith(prefix) for name in buckets)


def test_unreachable_endpoint_exits_2_naming_it(s3_endpoint, cli_env, capsys, monkeypatch, fresh_s3fs):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    line = refused(["run", "--store", "s3://islands-{bucket}", "--rounds", "1"], capsys, cli_env)
    assert "s3://islands-global" in line
    assert "not reachable" in line
    assert f"127.0.0.1:{port}" in line
    assert "AWS_ENDPOINT_URL" in line


def test_file_store_folders_are_created_and_count_as_reachable(tmp_path):
    cfg = RunConfig(regions=["us-east", "eu-west"], speed={}, store=f"file://{tmp_path}/islands-{{bucket}}")
    commands.preflight(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["islands-eu-west", "islands-global", "islands-us-east"]
    assert all(not any(p.iterdir()) for p in tmp_path.iterdir())  # folders only, no objects


def test_the_command_exits_with_mains_status_leaving_its_objects_to_the_system(monkeypatch):
    calls = []
    monkeypatch.setattr(cli, "main", lambda: calls.append("main") or 3)
    monkeypatch.setattr(cli.gc, "freeze", lambda: calls.append("freeze"))
    with pytest.raises(SystemExit) as info:
        cli.entry()
    assert info.value.code == 3
    assert calls == ["main", "freeze"]


@pytest.mark.parametrize(
    "name", ["eu", "x", "-ab", "ab-", "Us-east", "us_east", "us east", "üs-east", "us-\u0435ast", "a" * 43, "global"]
)
def test_a_refused_region_name_is_told_the_rule(name, cli_env, capsys, monkeypatch):
    line = refused(["run", "--regions", f"us-east,{name}"], capsys, cli_env, monkeypatch)
    assert line.startswith("islands: regions: ") or line.startswith("islands: --regions"), line
    assert "3–42 characters" in line and "beginning and ending with a letter or digit" in line, line


@pytest.mark.parametrize("name", ["abc", "a-1", "us-east", "a" * 42, "0-0"])
def test_region_names_of_the_rule_are_accepted(name):
    assert RunConfig(regions=[name], speed={}, quorum={"min_quorum": 1}).regions == [name]


@pytest.mark.parametrize("name", ["us-east\n", "us-east ", "US-EAST"])
def test_names_are_matched_whole(name):
    with pytest.raises(ValidationError, match="3–42 characters"):
        RunConfig(regions=[name], speed={}, quorum={"min_quorum": 1})
    with pytest.raises(ValidationError, match="3–42 characters"):
        RunConfig(run_id=name)


# -- every number is finite and bounded -------------------------------------------------------------


def float_settings():
    """(dotted path, whether it is a per-region table) of every float setting of RunConfig."""
    for path, field in run_flags.fields():
        if typing.get_origin(field.annotation) is dict:
            if typing.get_args(field.annotation)[1] is float:
                yield path, True
        elif float in (field.annotation, *typing.get_args(field.annotation)):
            yield path, False


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 1e300, -1e300])
def test_every_float_setting_is_finite_and_bounded(bad):
    paths = list(float_settings())
    assert len(paths) >= 15 and ("inner.lr", False) in paths and ("speed", True) in paths
    for path, per_region in paths:
        value = {"us-east": bad} if per_region else bad
        with pytest.raises(ConfigError) as info:
            load_config(None, {path: value})
        assert str(info.value).startswith(path), (path, str(info.value))


def test_polling_less_often_than_the_round_deadline_is_refused():
    with pytest.raises(ConfigError, match=r"^quorum.poll_s: 30 s is longer than round_timeout_s 10 s"):
        load_config(None, {"quorum.poll_s": 30, "quorum.round_timeout_s": 10})
