"""Bringing up the stack a command needs: the running `islands up` of this data folder, or an
embedded one (S3 endpoint, Prefect server, learner runner) for the command's lifetime, and its
environment made the process's own."""

from __future__ import annotations

import os
import re
import sys
import time
from contextlib import ExitStack

from islands.core.config import EMBEDDED_STORE, GLOBAL_BUCKET, NAME, NAME_RULE, ConfigError, RunConfig, embedded_buckets


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


def check_run_id(run_id: str) -> None:
    """A run id given on the command line is a run's name, as `islands run` makes them, or
    ConfigError: never a path (`../../x`) that would lead a reader outside the run's folder."""
    if not re.fullmatch(NAME, run_id, re.ASCII):
        raise ConfigError(f"{run_id[:60]!r} is not a run id; a run id has {NAME_RULE}, e.g. run-7f3a")


def open_run(scope: ExitStack, run_id: str, store: str | None) -> tuple[str, RunConfig, tuple | None]:
    """(the bucket template, the config, what `bring_up` gave) of an existing run, the embedded
    stack brought up when no store is given (else None); ConfigError when there is no such run,
    or `run_id` is not a run id (before anything starts)."""
    from islands.storage.rounds import read_config
    from islands.storage.store import IntegrityError, ObjectMissing, StoreError, Stores, check_template

    check_run_id(run_id)
    template = store or EMBEDDED_STORE
    try:
        check_template(template, [GLOBAL_BUCKET])
    except (StoreError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    stack = None
    if store is None:
        stack = bring_up(scope, embedded_buckets([]))
        adopt(stack[0])
    try:
        config = read_config(Stores(template, []).global_, run_id)
    except IntegrityError as exc:
        raise ConfigError(f"{run_id}: {exc}") from None
    except (ObjectMissing, StoreError) as exc:
        raise ConfigError(f"{run_id}: no such run in {template} ({exc})") from exc
    try:
        check_template(template, [GLOBAL_BUCKET, *config.regions])
    except StoreError as exc:
        raise ConfigError(str(exc)) from None
    return template, config, stack
