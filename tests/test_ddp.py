"""Several processes per learner: two gloo ranks on CPU, each training on half of every batch (DDP,
or FSDP2 sharding the model over them), give the delta one process gives with the whole batch; and
the learner deployment, given gpus_per_learner = 2, trains its phases as such torchrun jobs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from islands.core.config import InnerSettings, RunConfig
from islands.core.data import BatchSampler
from islands.core.inner import InnerTrainer
from islands.core.model import build_model, params_of
from islands.storage import layout
from islands.storage.codec import decode
from islands.tasks.ddp_phase import learner_trainer

STEPS = 3
RUN = "ddp-learner-run"


def run_config(corpus: Path, **fields) -> RunConfig:
    corpus.write_bytes(bytes((i * 7 + i // 13) % 256 for i in range(80_000)))
    inner = {"batch_size": 4, "warmup_steps": 1}
    return RunConfig(
        run_id=RUN, regions=["north", "south"], speed={}, corpus=str(corpus), inner=inner, torch_threads=1, **fields
    )


def one_process_phase(config: RunConfig, learner: str):
    """The phase trained in this process with the whole batch, from the run's seeded round 0."""
    trainer = learner_trainer(config.model_copy(update={"gpus_per_learner": 1}), learner, torch.device("cpu"))
    return trainer.run_phase(params_of(build_model(config.model, config.seed)), STEPS)


def job(tmp_path: Path, config: RunConfig, launcher: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    phase_dir = tmp_path / config.parallel
    phase_dir.mkdir()
    (phase_dir / "run.json").write_text(config.model_dump_json())
    # gloo on the loopback interface only; one thread per rank on a shared machine.
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    args = ["--config", str(phase_dir / "run.json"), "--learner", "north-0", "--dir", str(phase_dir)]
    cmd = [*launcher, "-m", "islands.tasks.ddp_phase", *args, "--steps", str(STEPS)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with safe_open(phase_dir / "delta.safetensors", "pt") as f:
        meta = f.metadata()
    return load_file(phase_dir / "delta.safetensors"), meta


def assert_close_deltas(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    assert max(t.abs().max().item() for t in want.values()) > 1e-4  # the phase really moved the weights
    for name in want:
        # AdamW divides each gradient by its own size: summation order shows in near-zero ones
        # (atol: 1% of a step of lr 1e-3; a rank training on the wrong slice is off by whole steps).
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=3e-5, msg=name)


TWO_RANKS = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def test_two_ranks_give_the_delta_of_one_process_with_the_whole_batch(tmp_path):
    """DDP and FSDP2 (fully_shard on CPU, over gloo) alike."""
    config = run_config(tmp_path / "corpus.txt", gpus_per_learner=2)
    one = one_process_phase(config, "north-0")
    for parallel in ("ddp", "fsdp"):
        two, meta = job(tmp_path, config.model_copy(update={"parallel": parallel}), TWO_RANKS)
        assert meta["world_size"] == "2" and meta["tokens"] == str(one.tokens) == str(STEPS * 4 * 128)
        assert abs(float(meta["loss"]) - one.loss) < 1e-5, parallel
        assert_close_deltas(two, dict(one.delta))
        # The state a job leaves is the one a learner's own process would: AdamW's moments, steps, cursor.
        state = load_file(tmp_path / parallel / "state.safetensors")
        assert int(state["trainer.step"]) == int(state["opt.step"]) == STEPS
        assert state.keys() == one_process_state_keys(config)


def one_process_state_keys(config: RunConfig) -> set[str]:
    return set(learner_trainer(config, "north-0", torch.device("cpu")).state_dict())


def test_parallel_training_needs_an_initialized_process_group():
    sampler = BatchSampler(bytes(range(256)) * 8, batch_size=2, block_size=16, seed=0)
    with pytest.raises(ValueError, match="torchrun"):
        InnerTrainer(build_model("tiny", 0), sampler, InnerSettings(), parallel="ddp")


def flow_run_logs(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        return [log.message for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))]


def test_the_learner_deployment_trains_a_phase_as_a_two_process_torchrun_job(on_stack, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from islands.flows.bring_up import wait_for_learner_deployment
    from islands.flows.training_run import create_run
    from islands.storage.store import Stores

    config = run_config(tmp_path / "corpus.txt", gpus_per_learner=2, inner_steps=STEPS, rounds=1)
    stores = Stores("s3://islands-{bucket}", config.regions)
    create_run(config, stores)
    params = {"run_id": RUN, "learner": "north-0", "store": stores.template}
    wait_for_learner_deployment("learner/local")  # the stack's runner registers it as it starts
    started = run_deployment("learner/local", parameters=params, timeout=0)
    key = layout.delta_key(RUN, "north-0", 0)
    deadline = time.monotonic() + 300  # a shared CI machine: the learner and its job start slowly
    while not stores.region("north").exists(key) and time.monotonic() < deadline:
        time.sleep(0.5)
    stores.global_.put_if_absent(layout.stop_key(RUN), b'{"why": "the test has its phase"}')
    with get_client(sync_client=True) as client:
        while not (fr := client.read_flow_run(started.id)).state.is_final() and time.monotonic() < deadline:
            time.sleep(0.5)
    assert fr.state.is_completed(), fr.state.message
    delta, meta = decode(stores.region("north").get(key))
    assert (meta["inner_steps"], meta["tokens"]) == (str(STEPS), str(STEPS * 4 * 128))
    assert_close_deltas(delta, dict(one_process_phase(config, "north-0").delta))
    time.sleep(2)  # the flow run's last logs reach the API
    assert any("torchrun job of 2 processes" in line for line in flow_run_logs(started.id))
