"""`islands`: the command line. Parses flags, validates the config before anything is written,
brings up (or reuses) the embedded stack, and runs the flows.

Exit status: 0 done, 1 the run failed, 2 bad configuration or unusable storage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from flows.config import ConfigError, RunConfig, load_config, new_run_id

EXIT_CONFIG = 2


def _speed(value: str) -> tuple[str, float]:
    region, sep, factor = value.partition("=")
    try:
        if not sep:
            raise ValueError
        return region, float(factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--speed takes REGION=FACTOR, e.g. eu-west=0.33 (got {value!r})") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="islands", description="Decoupled DiLoCo across regions through object storage.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train (no config: the embedded demo)")
    run.add_argument("--config", type=Path, help="TOML file with any RunConfig field")
    run.add_argument("--run-id")
    run.add_argument("--rounds", type=int)
    run.add_argument("--regions", help="comma-separated, e.g. us-east,eu-west")
    run.add_argument("--learners-per-region", type=int)
    run.add_argument("--inner-steps", type=int, help="H, inner steps per phase")
    run.add_argument("--min-quorum", type=int, help="Q_min")
    run.add_argument("--store", help="bucket URL template, e.g. s3://islands-{bucket} or file:///data/islands/{bucket}")
    run.add_argument("--corpus", help="fsspec URL or glob of the training text (default: stdlib)")
    run.add_argument("--model", help="tiny or small")
    run.add_argument("--codec", help="fp32 or bf16")
    run.add_argument("--speed", type=_speed, action="append", metavar="REGION=FACTOR", help="slow a region down (repeatable)")
    run.add_argument("--json", action="store_true", help="end with one JSON object")

    up = sub.add_parser("up", help="start the local S3 endpoint, Prefect server + UI and learner runner")
    up.add_argument("--regions", help="regional buckets to create (default: the demo's)")

    res = sub.add_parser("resume", help="continue a run from its last published round")
    res.add_argument("run_id")
    res.add_argument("--store", help="bucket URL template the run lives in (default: embedded S3)")
    res.add_argument("--json", action="store_true")
    return p


def overrides(args: argparse.Namespace) -> dict:
    out: dict = {}
    simple = {"run_id": "run_id", "rounds": "rounds", "inner_steps": "inner_steps", "store": "store", "corpus": "corpus",
              "model": "model", "codec": "codec", "learners_per_region": "learners_per_region"}
    for attr, field in simple.items():
        if getattr(args, attr, None) is not None:
            out[field] = getattr(args, attr)
    if args.regions:
        out["regions"] = [r.strip() for r in args.regions.split(",") if r.strip()]
    if args.min_quorum is not None:
        out["quorum.min_quorum"] = args.min_quorum
    if args.speed:
        out["speed"] = dict(args.speed)
    return out


def fail(message: str, code: int = EXIT_CONFIG) -> int:
    for line in message.splitlines():
        print(f"islands: {line}", file=sys.stderr)
    return code


def bring_up(stack_scope: ExitStack, buckets: list[str]) -> tuple[dict, bool]:
    """Environment of a running `islands up`, or of a stack started for this command's lifetime."""
    from infra.s3_server import create_buckets
    from infra.stack import LocalStack, default_data_dir, find_running, stack_env

    data_dir = default_data_dir()
    running = find_running(data_dir)
    if running:
        create_buckets(running["s3_url"], buckets)
        return {**stack_env(data_dir, running["s3_url"], running["api_url"]), "ISLANDS_UI_URL": running["ui_url"]}, True
    print(f"islands: starting the embedded stack (S3 endpoint, Prefect server, learner runner) in {data_dir} …", file=sys.stderr)
    stack = stack_scope.enter_context(LocalStack(data_dir, buckets))
    return {**stack.env(), "ISLANDS_UI_URL": stack.ui_url}, False


def wait_for_learner_deployment(name: str, timeout_s: float = 90.0) -> None:
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            try:
                client.read_deployment_by_name(name)
                return
            except Exception:  # noqa: BLE001 - not registered yet
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"deployment {name!r} did not appear within {timeout_s:.0f} s; see the learner runner's log"
                    ) from None
                time.sleep(0.5)


def preflight(config: RunConfig) -> None:
    """Every bucket must answer before anything is written."""
    from flows.training_run import store_template
    from storage.store import Stores

    for store in Stores(store_template(config), config.regions).all():
        store.check_reachable()


def execute(config: RunConfig, as_json: bool) -> int:
    """Run (or continue) `config` against the embedded stack or the configured store."""
    from storage.store import StoreError

    with ExitStack() as scope:
        if config.store is None or "PREFECT_API_URL" not in os.environ:
            env, reused = bring_up(scope, ["islands-global", *(f"islands-{r}" for r in config.regions)])
            if config.store is not None:
                env.pop("AWS_ENDPOINT_URL", None)
            os.environ.update(env)
        else:
            reused = True
        try:
            preflight(config)
        except StoreError as exc:
            return fail(str(exc))
        if "{region}" not in config.learner_deployment:
            wait_for_learner_deployment(config.learner_deployment)
        from flows.training_run import training_run

        summary = training_run(config)
        ui = os.environ.get("ISLANDS_UI_URL")
        if ui:
            hint = f"open {ui}" if reused else "run `islands up` to browse it again (its S3 buckets are restored)"
            print(f"Prefect UI: {hint}; flow runs are named {summary['run_id']}/round-NNN", file=sys.stderr)
    if as_json:
        print(json.dumps(summary))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, overrides(args))
    except ConfigError as exc:
        return fail(str(exc))
    if config.run_id is None:
        config = config.model_copy(update={"run_id": new_run_id()})
    return execute(config, args.json)


def cmd_resume(args: argparse.Namespace) -> int:
    from storage.rounds import read_config
    from storage.store import ObjectMissing, StoreError, Stores

    with ExitStack() as scope:
        if args.store is None:
            os.environ.update(bring_up(scope, ["islands-global"])[0])
        template = args.store or "s3://islands-{bucket}"
        try:
            config = RunConfig.model_validate(read_config(Stores(template, []).global_, args.run_id))
        except (ObjectMissing, StoreError) as exc:
            return fail(f"{args.run_id}: no such run in {template} ({exc})")
    return execute(config, args.json)


def cmd_up(args: argparse.Namespace) -> int:
    from infra.stack import LocalStack, default_data_dir

    regions = args.regions.split(",") if args.regions else RunConfig().regions
    with LocalStack(default_data_dir(), ["islands-global", *(f"islands-{r}" for r in regions)]).start(record=True) as stack:
        print(f"S3 endpoint : {stack.s3_url}   (AWS_ENDPOINT_URL; buckets islands-global, islands-<region>)")
        print(f"Prefect API : {stack.api_url}")
        print(f"Prefect UI  : {stack.ui_url}")
        print("Learner runner serving deployment learner/local. Ctrl-C stops everything.", flush=True)
        while True:
            time.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    commands = {"run": cmd_run, "up": cmd_up, "resume": cmd_resume}
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        print("islands: interrupted; every process this command started has been stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
