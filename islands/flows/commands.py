"""What each `islands` command does, once its flags are parsed (islands.flows.cli).

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

from islands.core.config import (
    EMBEDDED_STORE,
    GLOBAL_BUCKET,
    ConfigError,
    RunConfig,
    embedded_buckets,
    load_config,
    new_run_id,
    store_template,
)
from islands.flows.bring_up import (
    adopt,
    bring_up,
    check_run_id,
    on_embedded_prefect,
    open_run,
    wait_for_learner_deployment,
)
from islands.flows.run_flags import overrides

EXIT_CONFIG = 2


def fail(message: str, code: int = EXIT_CONFIG) -> int:
    for line in message.splitlines():
        print(f"islands: {line}", file=sys.stderr)
    return code


def preflight(config: RunConfig) -> None:
    """Before anything is written: every bucket must answer, and the store must refuse a second
    create-only write of one key (and keep objects under retention, with object_lock_days)."""
    from islands.flows.buckets import prepare_buckets
    from islands.storage.store import Stores

    prepare_buckets(config, Stores(store_template(config), config.regions))


def check_data(config: RunConfig, take_tokenizer: bool = False) -> RunConfig:
    """Before anything is written: the corpus and tokenizer exist and fit the model (ValueError,
    one line). With `take_tokenizer` (a new run), a run naming no tokenizer is given the one its
    token shards were made with; the config to run."""
    from islands.core.model import spec_vocab_and_context
    from islands.storage.corpus import check_corpus, shards_tokenizer
    from islands.storage.model_files import local_model

    if take_tokenizer and config.tokenizer is None:
        if (made_with := shards_tokenizer(config.corpus, config.eval_corpus)) is not None:
            config = config.model_copy(update={"tokenizer": made_with})
    vocab, _ = spec_vocab_and_context(local_model(config.model), config.seed)
    check_corpus(config.corpus, config.eval_corpus, config.tokenizer, vocab)
    return config


def on_embedded_s3(config: RunConfig) -> bool:
    """Whether the run's model, corpus or tokenizer may be on the embedded S3 endpoint, which
    answers only once the stack is up: an s3:// (or other remote) URL in a run on the embedded store."""
    from islands.storage.model_files import is_remote

    urls = (config.model, config.corpus, config.eval_corpus, config.tokenizer)
    return config.store is None and any(url is not None and is_remote(url) for url in urls)


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


def execute(
    config: RunConfig,
    as_json: bool,
    chaos: list[str] | None = None,
    stack: tuple | None = None,
    take_tokenizer: bool = False,
) -> int:
    """Run (or continue) `config` against the embedded stack or the configured store; `stack`
    is what `bring_up` gave the caller, when it brought the stack up already. The data is checked
    (`check_data`, with `take_tokenizer`) before any stack starts, unless it is on the embedded
    S3 endpoint."""
    from islands.flows.chaos import Chaos
    from islands.infra.s3_proxy import S3Proxy
    from islands.storage.store import StoreError, check_template

    try:  # before any stack starts: buckets that alias would take each other's deltas
        check_template(store_template(config), [GLOBAL_BUCKET, *config.regions])
    except StoreError as exc:
        return fail(str(exc))
    early = not on_embedded_s3(config)
    if early:
        try:
            config = check_data(config, take_tokenizer)
        except ValueError as exc:
            return fail(str(exc))
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
                    embedded_buckets(config.regions),
                    s3_front if stalls else None,
                    s3=config.store is None,
                )
            except ConfigError as exc:
                return fail(str(exc))
            adopt(env)
        else:
            reused = True
        try:
            if not early:
                config = check_data(config, take_tokenizer)
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
    if summary.get("failed"):
        return fail(f"{summary['run_id']}: {summary['failed']}", 1)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, overrides(args))
    except ConfigError as exc:
        return fail(str(exc))
    if config.run_id is None:
        config = config.model_copy(update={"run_id": new_run_id()})
    problem = check_faults(config, args.chaos or []) or check_model_spec(config)
    return fail(problem) if problem else execute(config, args.json, args.chaos, take_tokenizer=True)


def cmd_prepare(args: argparse.Namespace) -> int:
    """Tokenize SRC into shards under DST, showing a progress bar over the text."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from islands.storage.model_files import is_remote
    from islands.storage.prepare import groups, prepare
    from islands.storage.shards import foreign_files, prepared_names
    from islands.storage.store import bucket_holding
    from islands.storage.tokenizer import load_tokenizer

    if not args.shard_mb > 0:
        return fail(f"--shard-mb {args.shard_mb:g}: give the megabytes of text per shard, more than 0")
    template = args.store or EMBEDDED_STORE
    if "{bucket}" not in template:
        return fail(f"--store {template}: must contain '{{bucket}}', e.g. s3://islands-{{bucket}}")
    bucket = bucket_holding(args.dst, template)
    if bucket is not None:
        return fail(
            f"DST: {args.dst} is inside {bucket}, a bucket of the store {template}, whose objects only runs write; "
            "give a folder outside it" + ("" if args.store else " (or --store with your runs' own template)")
        )
    shard_bytes = int(args.shard_mb * 1e6)
    try:
        tokenizer = load_tokenizer(args.tokenizer, "--tokenizer")
        plan = groups(args.src, tokenizer, shard_bytes)
    except ValueError as exc:
        return fail(str(exc))
    foreign = [] if args.force else foreign_files(args.dst, prepared_names([g.name for g in plan]))
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        return fail(
            f"DST: {args.dst} holds {shown}, which islands prepare did not write; nothing written: "
            "give an empty folder, or --force to replace them"
        )
    local = None if is_remote(args.dst) else Path(args.dst.removeprefix("file://")).absolute()
    made_folders = [p for p in (local, *local.parents) if not p.exists()] if local else []
    columns = (TextColumn("[bold]prepare"), BarColumn(), DownloadColumn(), TextColumn("{task.fields[shards]}"))
    try:
        with Progress(*columns, TimeRemainingColumn(), transient=False) as bar:
            task = bar.add_task("prepare", total=sum(g.bytes for g in plan), shards=f"0/{len(plan)} shards")
            done = skipped = 0

            def on_shard(size: int, made: bool) -> None:
                nonlocal done, skipped
                done += 1
                skipped += not made
                bar.update(task, advance=size, shards=f"{done}/{len(plan)} shards, {skipped} already there")

            dataset, made = prepare(plan, args.dst, tokenizer, args.tokenizer, args.workers, on_shard)
    except (ValueError, OSError) as exc:  # text that does not read (CorpusError names the file and where)
        for folder in made_folders:  # the folders this prepare made, deepest first, while empty
            try:
                folder.rmdir()
            except OSError:
                break
        return fail(str(exc))
    tokens = sum(s.tokens for s in dataset.shards)
    print(
        f"islands: {args.dst}: {len(dataset.shards)} shards ({made} written, {len(dataset.shards) - made} already "
        f"there), {tokens:,} {dataset.dtype} tokens, tokenizer {dataset.tokenizer.name} "
        f"(vocabulary {dataset.tokenizer.vocab_size})"
    )
    return 0


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
    buckets = embedded_buckets(regions)
    with LocalStack(default_data_dir(), buckets).start(record=True) as stack:
        print(f"S3 endpoint : {stack.s3_url}   (AWS_ENDPOINT_URL; buckets {', '.join(buckets)})")
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
            env, _ = bring_up(scope, embedded_buckets(config.regions))
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
        check_run_id(args.run_id)
    except ConfigError as exc:
        return fail(str(exc))
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
            template, config, _ = open_run(scope, args.run_id, args.store)
            stores = Stores(template, config.regions)
            manifest, names = export_round(stores, args.run_id, args.round, args.out, args.force)
        except IntegrityError as exc:
            return fail(f"{args.run_id}: the checkpoint does not match its manifest, nothing written ({exc})", 1)
        except (ConfigError, ExportError, ModelError, TokenizerError) as exc:
            return fail(str(exc))
    print(f"islands: round {manifest.round} of {args.run_id} written to {args.out}: {', '.join(names)}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    """Simulate the run the config describes: decoupled, synchronous DiLoCo and data-parallel
    under the same drawn failures (islands.core.simulate), with a progress bar."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from islands.core.simulate import load_sim_config, report, simulate

    if args.calibrate:
        return calibrate_simulation(args)
    given = {"seed": args.seed, "run.hours": args.hours}
    try:
        config = load_sim_config(args.config, {k: v for k, v in given.items() if v is not None})
    except ConfigError as exc:
        return fail(str(exc))
    columns = (TextColumn("[bold]simulate"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn())
    with Progress(*columns, transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task("simulate", total=1.0)
        result = simulate(config, on_progress=lambda done: bar.update(task, completed=done))
    print("\n".join(report(result, config)))
    if args.json:
        print(json.dumps(result.summary()))
    return 0


def calibrate_simulation(args: argparse.Namespace) -> int:
    """`islands simulate --calibrate RUN`: the recorded run beside its simulation."""
    from islands.ops.calibrate import calibration
    from islands.ops.status import locate
    from islands.storage.store import ObjectMissing, StoreError

    try:
        found = calibration(args.calibrate, locate(args.store), args.seed or 0)
    except ObjectMissing:
        return fail(f"{args.calibrate}: no such run; check the run id or pass --store")
    except (ValueError, StoreError) as exc:
        return fail(f"simulate --calibrate: {exc}")
    real, predicted, error = found["recorded"], found["predicted"], found["error"]
    print(f"{'':<22}{'recorded':>12}{'simulated':>12}{'off by':>9}")
    print(f"{'rounds':<22}{real['rounds']:>12}{predicted['rounds']:>12}{error['rounds']:>9.1%}")
    for reason, off in error["closings"].items():
        a, b = real["closings"].get(reason, 0), predicted["closings"].get(reason, 0)
        print(f"{'closed ' + reason:<22}{a:>12}{b:>12}{off:>9.1%}")
    print(f"{'delta bytes':<22}{real['bytes']:>12,.0f}{predicted['bytes']:>12,.0f}{error['bytes']:>9.1%}")
    if args.json:
        print(json.dumps(found))
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
