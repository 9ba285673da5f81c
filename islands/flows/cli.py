"""`islands`: the command line. Parses flags, validates the config before anything is written,
brings up (or reuses) the embedded stack, and runs the flows.

Exit status: 0 done, 1 the run failed, 2 bad configuration or unusable storage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from islands.core.config import ConfigError, RunConfig, load_config, new_run_id, store_template

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
    run.add_argument("--target-loss", type=float, help="stop once a round's held-out eval loss is at most this")
    run.add_argument("--token-budget", type=int, help="stop once the rounds have merged this many trained tokens")
    run.add_argument("--eval-every", type=int, help="evaluate every N-th round (and the last); 0: the last only")
    run.add_argument("--regions", help="comma-separated, e.g. us-east,eu-west")
    run.add_argument("--learners-per-region", type=int)
    run.add_argument("--inner-steps", type=int, help="H, inner steps per phase")
    run.add_argument("--min-quorum", type=int, help="Q_min")
    run.add_argument("--store", help="bucket URL template, e.g. s3://islands-{bucket} or file:///data/islands/{bucket}")
    run.add_argument("--corpus", help="token shards (folder with dataset.json) or text: URL, glob or folder")
    run.add_argument("--eval-corpus", help="held-out split, as --corpus takes (default: from the corpus)")
    run.add_argument("--tokenizer", help="tokenizer of a text corpus (default: bytes)")
    run.add_argument(
        "--model", help="tiny, small, a Hugging Face model folder or config.json, or python:module:function"
    )
    run.add_argument("--codec", help="fp32, bf16, int8, int4, int3 or int2")
    run.add_argument(
        "--speed", type=_speed, action="append", metavar="REGION=FACTOR", help="slow a region down (repeatable)"
    )
    run.add_argument("--json", action="store_true", help="end with one JSON object")
    run.add_argument(
        "--chaos",
        action="append",
        metavar="SPEC",
        help="inject a fault (repeatable or comma-separated): kill:REGION@roundN, restart:REGION@roundN, "
        "stall:s3@40s+20s, crash:synchronizer@POINT[@roundN]",
    )

    prep = sub.add_parser("prepare", help="tokenize text into token shards and their dataset.json, on all cores")
    prep.add_argument("src", help="text: a file, folder or glob of .txt, .jsonl or .parquet (fsspec URL), or stdlib")
    prep.add_argument("dst", help="folder for the shards, any fsspec URL, e.g. s3://bucket/data/corpus")
    prep.add_argument("--tokenizer", help="tokenizer.json or Hugging Face tokenizer folder (default: bytes)")
    prep.add_argument("--shard-mb", type=float, default=64.0, help="text per shard, in MB (default 64)")
    prep.add_argument("--workers", type=int, help="processes (default: every core)")

    up = sub.add_parser("up", help="start the local S3 endpoint, Prefect server + UI and learner runner")
    up.add_argument("--regions", help="regional buckets to create (default: the demo's)")

    res = sub.add_parser("resume", help="continue a run from its last published round")
    res.add_argument("run_id")
    res.add_argument("--store", help="bucket URL template the run lives in (default: embedded S3)")
    res.add_argument("--json", action="store_true")

    pl = sub.add_parser("plan", help="WAN bandwidth each scheme needs: data-parallel vs DiLoCo vs decoupled")
    pl.add_argument("--params", type=float, default=10e9, help="model parameters, e.g. 1e9")
    pl.add_argument("--step-time", type=float, default=1.0, help="seconds of compute per inner step")
    pl.add_argument("--inner-steps", type=int, default=100, help="H, inner steps per phase")
    pl.add_argument("--replicas", type=int, default=4, help="regions (workers) that exchange updates")
    pl.add_argument("--bits", type=int, default=4, help="bits per value of the decoupled delta (codec)")
    pl.add_argument(
        "--checkpoint-bits", type=int, default=32, help="bits per value of the checkpoint learners download"
    )
    pl.add_argument(
        "--overlap", type=int, help="τ: steps of compute a transfer (a fragment's) hides behind (default: H/F)"
    )
    pl.add_argument(
        "--fragments", type=int, default=1, help="F: send the model in F fragments, one every H/F steps (streamed)"
    )
    pl.add_argument("--utilization", type=float, default=0.95, help="target compute utilization, e.g. 0.95")
    pl.add_argument("--link-gbps", type=float, default=2.0, help="link for the checkpoint transfer time")
    pl.add_argument("--check", action="store_true", help="compare with published figures instead")

    srv = sub.add_parser("serve", help="register the deployments so runs can be started or scheduled from the UI")
    srv.add_argument("--config", type=Path, help="TOML file whose fields become the run form's defaults")
    when = srv.add_mutually_exclusive_group()
    when.add_argument("--interval", type=float, metavar="SECONDS", help="start a training run every SECONDS")
    when.add_argument("--cron", metavar="EXPR", help="start a training run on this cron schedule, e.g. '0 3 * * *'")

    st = sub.add_parser("status", help="rounds, contributors, learners alive/late/dead, latest eval loss")
    st.add_argument("run_id")
    st.add_argument("--store", help="bucket URL template the run lives in (default: embedded S3)")
    st.add_argument("--json", action="store_true", help="one JSON object (with --watch: one per line)")
    st.add_argument(
        "--watch",
        type=float,
        metavar="SECONDS",
        help="show it again every SECONDS until the run is finished; waits for a run not created yet",
    )

    aud = sub.add_parser(
        "audit", help="verify a run from storage: hash chain, objects, token ledger; its head against Prefect's record"
    )
    aud.add_argument("run_id")
    aud.add_argument("--store", help="bucket URL template the run lives in (default: embedded S3)")
    aud.add_argument("--replay", action="store_true", help="also recompute every merge and compare the bits")
    aud.add_argument("--json", action="store_true", help="print the report as one JSON object")
    exp = sub.add_parser("export", help="write a round as files transformers (or safetensors) loads")
    exp.add_argument("run_id")
    exp.add_argument("out", metavar="OUT", help="folder or fsspec URL (e.g. s3://bucket/models/run-1) to write to")
    exp.add_argument("--round", type=int, help="the round to export (default: the newest)")
    exp.add_argument("--store", help="bucket URL template the run lives in (default: embedded S3)")
    return p


def overrides(args: argparse.Namespace) -> dict:
    out: dict = {}
    simple = {
        "run_id": "run_id",
        "rounds": "rounds",
        "target_loss": "target_loss",
        "token_budget": "token_budget",
        "eval_every": "eval_every",
        "inner_steps": "inner_steps",
        "store": "store",
        "corpus": "corpus",
        "eval_corpus": "eval_corpus",
        "tokenizer": "tokenizer",
        "model": "model",
        "codec": "codec",
        "learners_per_region": "learners_per_region",
    }
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


def adopt(env: dict[str, str]) -> None:
    """Make `env` this process's environment. With the embedded S3 endpoint (env names it), the
    caller's own AWS settings go first: its test credentials are used with that endpoint alone,
    and nothing of the caller's (a profile, a session token) is sent with them."""
    if "AWS_ENDPOINT_URL" in env:
        for key in [k for k in os.environ if k.startswith("AWS_")]:
            del os.environ[key]
    os.environ.update(env)


def on_embedded_prefect() -> bool:
    """Whether this command uses the embedded Prefect: no PREFECT_API_URL, or the one a running
    `islands up` in this data folder printed (exported, as a user does to use the `prefect` CLI)."""
    from islands.infra.stack import default_data_dir, find_running

    api = os.environ.get("PREFECT_API_URL")
    if api is None:
        return True
    running = find_running(default_data_dir())
    return running is not None and running["api_url"] == api.rstrip("/")


def bring_up(stack_scope: ExitStack, buckets: list[str], s3_front=None, s3: bool = True) -> tuple[dict, bool]:
    """Environment of a running `islands up`, or of a stack started for this command's lifetime.

    `s3_front` (a fault proxy) needs a stack of its own, so that every process goes through it.
    With s3=False (the run has a store of its own) the stack started has no S3 endpoint, and its
    environment names none: every process reaches the store with the caller's AWS settings.
    """
    from islands.infra.s3_server import create_buckets
    from islands.infra.stack import LocalStack, default_data_dir, find_running, stack_env

    data_dir = default_data_dir()
    running = find_running(data_dir)
    if running and not s3:
        raise ConfigError(
            f"store: `islands up` (pid {running['pid']}) serves {data_dir}, and its learners use its own S3 "
            "endpoint, not your store; stop it, or set ISLANDS_HOME to another folder"
        )
    if running and s3_front is not None:
        raise ConfigError(
            f"--chaos stall:s3 needs a stack of its own, but `islands up` is serving {data_dir}; "
            "stop it, or set ISLANDS_HOME to another folder"
        )
    if running:
        create_buckets(running["s3_url"], buckets)
        return {**stack_env(data_dir, running["s3_url"], running["api_url"]), "ISLANDS_UI_URL": running["ui_url"]}, True
    print(
        f"islands: starting the embedded stack ({'S3 endpoint, ' if s3 else ''}Prefect server, learner runner) "
        f"in {data_dir} …",
        file=sys.stderr,
    )
    stack = stack_scope.enter_context(LocalStack(data_dir, buckets if s3 else [], s3_front=s3_front, s3=s3))
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
    """Before anything is written: every bucket must answer, and the store must refuse a second
    create-only write of one key (and keep objects under retention, with object_lock_days)."""
    from islands.flows.buckets import prepare_buckets
    from islands.storage.store import Stores

    prepare_buckets(config, Stores(store_template(config), config.regions))


def check_data(config: RunConfig) -> None:
    """Before anything is written: the corpus and tokenizer exist and fit the model (ValueError, one line)."""
    from islands.core.model import spec_vocab_and_context
    from islands.storage.corpus import check_corpus
    from islands.storage.model_files import local_model

    vocab, _ = spec_vocab_and_context(local_model(config.model), config.seed)
    check_corpus(config.corpus, config.eval_corpus, config.tokenizer, vocab)


def cmd_prepare(args: argparse.Namespace) -> int:
    """Tokenize SRC into shards under DST, showing a progress bar over the text."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from islands.storage.prepare import groups, prepare
    from islands.storage.tokenizer import load_tokenizer

    if not args.shard_mb > 0:
        return fail(f"--shard-mb {args.shard_mb:g}: give the megabytes of text per shard, more than 0")
    shard_bytes = int(args.shard_mb * 1e6)
    try:
        tokenizer = load_tokenizer(args.tokenizer, "--tokenizer")
        plan = groups(args.src, tokenizer, shard_bytes)
    except ValueError as exc:
        return fail(str(exc))
    columns = (TextColumn("[bold]prepare"), BarColumn(), DownloadColumn(), TextColumn("{task.fields[shards]}"))
    with Progress(*columns, TimeRemainingColumn(), transient=False) as bar:
        task = bar.add_task("prepare", total=sum(g.bytes for g in plan), shards=f"0/{len(plan)} shards")
        done = skipped = 0

        def on_shard(size: int, made: bool) -> None:
            nonlocal done, skipped
            done += 1
            skipped += not made
            bar.update(task, advance=size, shards=f"{done}/{len(plan)} shards, {skipped} already there")

        dataset, made = prepare(plan, args.dst, tokenizer, args.tokenizer, args.workers, on_shard)
    tokens = sum(s.tokens for s in dataset.shards)
    print(
        f"islands: {args.dst}: {len(dataset.shards)} shards ({made} written, {len(dataset.shards) - made} already "
        f"there), {tokens:,} {dataset.dtype} tokens, tokenizer {dataset.tokenizer.name} "
        f"(vocabulary {dataset.tokenizer.vocab_size})"
    )
    return 0


def execute(config: RunConfig, as_json: bool, chaos: list[str] | None = None, stack: tuple | None = None) -> int:
    """Run (or continue) `config` against the embedded stack or the configured store; `stack`
    is what `bring_up` gave the caller, when it brought the stack up already."""
    from islands.flows.chaos import Chaos
    from islands.infra.s3_proxy import S3Proxy
    from islands.storage.store import StoreError

    stalls = Chaos.parse(chaos or []).stalls
    proxies: list[S3Proxy] = []
    with ExitStack() as scope:

        def s3_front(url: str) -> str:
            proxies.append(scope.enter_context(S3Proxy(url)))
            return proxies[0].url

        if stalls and config.store is not None:
            return fail("--chaos stall:s3 works on the embedded S3 endpoint only; drop --store")
        if stack is not None:
            reused = stack[1]
        elif config.store is None or on_embedded_prefect():
            try:
                env, reused = bring_up(
                    scope,
                    ["islands-global", *(f"islands-{r}" for r in config.regions)],
                    s3_front if stalls else None,
                    s3=config.store is None,
                )
            except ConfigError as exc:
                return fail(str(exc))
            adopt(env)
        else:
            reused = True
        try:
            check_data(config)
            preflight(config)
        except (StoreError, ValueError) as exc:
            return fail(str(exc))
        if "{region}" not in config.learner_deployment and "{learner}" not in config.learner_deployment:
            wait_for_learner_deployment(config.learner_deployment)
        from islands.flows.training_run import training_run

        for stall in stalls:
            proxies[0].stall(stall.at_s, stall.for_s)
        summary = training_run(config, chaos or None)
        for stall in stalls:
            print(
                f"islands: chaos: S3 stalled for {stall.for_s:g} s from {stall.at_s:g} s into the run; "
                f"{proxies[0].held} transfers were held and went through after it",
                file=sys.stderr,
            )
        ui = os.environ.get("ISLANDS_UI_URL")
        if ui:
            hint = f"open {ui}" if reused else "run `islands up` to browse it again (with its S3 buckets)"
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
    problem = check_faults(config, args.chaos or []) or check_model_spec(config)
    return fail(problem) if problem else execute(config, args.json, args.chaos)


def check_model_spec(config: RunConfig) -> str | None:
    """What is wrong with the run's `model`, before anything is written (islands.core.model.check_model)."""
    from islands.core.model import ModelError, check_model
    from islands.storage.model_files import local_model

    try:
        check_model(local_model(config.model))
    except ModelError as exc:
        return str(exc)
    return None


def check_faults(config: RunConfig, chaos: list[str]) -> str | None:
    """What is wrong with --chaos or $ISLANDS_CRASH for this run, before anything starts."""
    from islands.flows.chaos import Chaos, ChaosError
    from islands.tasks.crash import CrashSpecError, armed

    try:
        armed()
        Chaos.parse(chaos).check(config.regions, config.rounds)
    except (ChaosError, CrashSpecError) as exc:
        return str(exc)
    return None


def open_run(scope: ExitStack, run_id: str, store: str | None) -> tuple[str, RunConfig, tuple | None]:
    """(the bucket template, the config, what `bring_up` gave) of an existing run, the embedded
    stack brought up when no store is given (else None); ConfigError when there is no such run."""
    from islands.storage.rounds import read_config
    from islands.storage.store import ObjectMissing, StoreError, Stores

    stack = None
    if store is None:
        stack = bring_up(scope, ["islands-global"])
        adopt(stack[0])
    template = store or "s3://islands-{bucket}"
    try:
        return template, read_config(Stores(template, []).global_, run_id), stack
    except (ObjectMissing, StoreError) as exc:
        raise ConfigError(f"{run_id}: no such run in {template} ({exc})") from exc


def cmd_resume(args: argparse.Namespace) -> int:
    with ExitStack() as scope:
        try:
            _, config, stack = open_run(scope, args.run_id, args.store)
        except ConfigError as exc:
            return fail(str(exc))
        problem = check_faults(config, [])
        return fail(problem) if problem else execute(config, args.json, stack=stack)


def cmd_up(args: argparse.Namespace) -> int:
    from islands.infra.stack import LocalStack, default_data_dir

    regions = args.regions.split(",") if args.regions else RunConfig().regions
    with LocalStack(default_data_dir(), ["islands-global", *(f"islands-{r}" for r in regions)]).start(
        record=True
    ) as stack:
        print(f"S3 endpoint : {stack.s3_url}   (AWS_ENDPOINT_URL; buckets islands-global, islands-<region>)")
        print(f"Prefect API : {stack.api_url}")
        print(f"Prefect UI  : {stack.ui_url}")
        print("Learner runner serving deployment learner/local. Ctrl-C stops everything.", flush=True)
        while True:
            time.sleep(3600)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, {})
    except ConfigError as exc:
        return fail(str(exc))
    scheduled = args.interval is not None or args.cron is not None
    if scheduled and config.run_id is not None:
        return fail(
            f"run_id: fixed to {config.run_id!r}, so every scheduled run would continue that one run; "
            "remove run_id from the config so each run gets a fresh one"
        )
    with ExitStack() as scope:
        embedded = on_embedded_prefect()
        if embedded:
            env, _ = bring_up(scope, ["islands-global", *(f"islands-{r}" for r in config.regions)])
            adopt(env)
            print(f"Prefect UI: {env['ISLANDS_UI_URL']}", file=sys.stderr)
        # Prefect reads its settings when first imported: only after the stack's are in place.
        from islands.flows.serve import driver_deployments, learner_deployment, serve_deployments

        deployments = driver_deployments(config, args.interval, args.cron)
        if not embedded:  # the embedded stack's own runner serves learner/local already
            deployments.append(learner_deployment())
        names = ", ".join(d.full_name for d in deployments)
        print(f"islands: serving {names}; Ctrl-C stops", file=sys.stderr, flush=True)
        serve_deployments(deployments)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from islands.ops.status import NoSuchRun, render, run_status, watch
    from islands.storage.store import StoreError

    try:
        if args.watch is None:
            reports = [run_status(args.run_id, args.store)]
        elif not args.watch > 0:
            return fail(f"--watch {args.watch:g}: give the seconds between two looks, more than 0")
        else:
            reports = watch(args.run_id, args.store, args.watch)
        waiting = None
        for report in reports:
            if isinstance(report, NoSuchRun):
                if str(report) != waiting:  # once, not every look
                    waiting = str(report)
                    print(f"islands: {report}; waiting", file=sys.stderr, flush=True)
            else:
                print(json.dumps(report) if args.json else render(report) + ("\n" if args.watch else ""), flush=True)
    except StoreError as exc:
        return fail(str(exc))
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """Exit 0 when every check holds, 1 naming each round and object that does not."""
    from islands.ops.audit import audit_run
    from islands.storage.store import Stores

    with ExitStack() as scope:
        try:
            template, config, _ = open_run(scope, args.run_id, args.store)
        except ConfigError as exc:
            return fail(str(exc))
        from islands.ops.witness import read_witness

        stores = Stores(template, config.regions)
        report = audit_run(stores, args.run_id, args.replay, read_witness(args.run_id, stores.global_.url))
    print(json.dumps(report.to_dict()) if args.json else report.summary())
    return 0 if report.ok else 1


def cmd_export(args: argparse.Namespace) -> int:
    """Exit 0 once OUT holds the round, 2 when OUT, the run or the round is not usable (nothing written)."""
    from islands.core.model import ModelError
    from islands.ops.export import ExportError, export_round
    from islands.storage.store import IntegrityError, Stores
    from islands.storage.tokenizer import TokenizerError

    with ExitStack() as scope:
        try:
            template, _, _ = open_run(scope, args.run_id, args.store)
            manifest, names = export_round(Stores(template, []), args.run_id, args.round, args.out)
        except IntegrityError as exc:
            return fail(f"{args.run_id}: the checkpoint does not match its manifest, nothing written ({exc})", 1)
        except (ConfigError, ExportError, ModelError, TokenizerError) as exc:
            return fail(str(exc))
    print(f"islands: round {manifest.round} of {args.run_id} written to {args.out}: {', '.join(names)}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from islands.core.plan import Workload, check_lines, report

    if args.check:
        print("\n".join(check_lines()))
        return 0
    try:
        w = Workload(
            params=args.params,
            step_s=args.step_time,
            inner_steps=args.inner_steps,
            replicas=args.replicas,
            utilization=args.utilization,
            delta_bits=args.bits,
            checkpoint_bits=args.checkpoint_bits,
            overlap_steps=args.inner_steps // max(args.fragments, 1) if args.overlap is None else args.overlap,
        )
        print("\n".join(report(w, args.link_gbps, args.checkpoint_bits, args.fragments)))
    except ValueError as exc:
        return fail(f"plan: {exc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    commands = {
        "run": cmd_run,
        "prepare": cmd_prepare,
        "up": cmd_up,
        "resume": cmd_resume,
        "serve": cmd_serve,
        "status": cmd_status,
        "audit": cmd_audit,
        "plan": cmd_plan,
        "export": cmd_export,
    }
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        print("islands: interrupted; every process this command started has been stopped", file=sys.stderr)
        return 130


def entry() -> None:
    """The `islands` command. Its status is `main`'s; what the process made is left out of the
    interpreter's last garbage collections, which walked every object torch and Prefect had made
    (about a second of a core after each run) only for the system to take the memory back."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
