"""Synchronous DiLoCo with its learners in worker processes is the serial loop at one thread, bit for
bit, every round; data-parallel in two ranks is the one-process model within float rounding; a
worker or rank that fails raises in the caller and leaves no process behind."""

import multiprocessing

import pytest
import torch

from benchmarks.heldout import PRESET
from benchmarks.inprocess import Budget, sync_diloco, train_data_parallel
from islands.core.config import MergeSettings
from islands.core.model import build_model

RULE = MergeSettings(outer_lr=0.7, outer_momentum=0.9)
BUDGET = Budget(learners=3, steps=4, warmup=1)  # three: the workers hold unequal shares (0, 2 and 1)


def test_learners_in_two_processes_give_the_serial_run_bit_for_bit():
    torch.set_num_threads(1)
    serial_rounds, proc_rounds = [], []
    serial = sync_diloco(BUDGET, 0, 2, RULE, on_round=lambda r, theta: serial_rounds.append((r, theta)))
    procs = sync_diloco(BUDGET, 0, 2, RULE, on_round=lambda r, theta: proc_rounds.append((r, theta)), procs=2)
    assert [r for r, _ in proc_rounds] == [r for r, _ in serial_rounds] == [1, 2]
    assert all(torch.equal(a[n], b[n]) for (_, a), (_, b) in zip(proc_rounds, serial_rounds) for n in serial)
    assert all(torch.equal(procs[n], serial[n]) for n in serial)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(
    "budget, init",
    [
        (Budget(steps=4, warmup=5), None),  # the workers fail building their trainers
        (BUDGET, {"no such weight": torch.zeros(1)}),  # they fail in the first phase
    ],
    ids=["building", "training"],
)
def test_a_failing_worker_raises_its_error_in_the_caller_and_leaves_no_process(budget, init):
    with pytest.raises(RuntimeError, match="a learner worker failed") as failed:
        sync_diloco(budget, 0, 2, RULE, init=init, procs=2)
    assert ("warmup_steps" if init is None else "unexpected ['no such weight']") in str(failed.value)
    assert not multiprocessing.active_children()


DP_BUDGET = Budget(learners=2, steps=4, warmup=1)


def test_data_parallel_in_two_ranks_gives_the_one_process_model():
    torch.set_num_threads(1)
    start = build_model(PRESET, 0).state_dict()
    one = train_data_parallel(DP_BUDGET, 0)
    two = train_data_parallel(DP_BUDGET, 0, procs=2)
    for got, want in zip(two, one):  # the final model, then the half-way one
        assert got.keys() == want.keys()
        # AdamW's first steps move every weight by about lr (1e-3 here) whatever the gradient's
        # size, so the ranks' float rounding shows as up to ~3e-6 of it
        assert max((got[n] - want[n]).abs().max().item() for n in want) < 1e-5
        assert max((want[n] - start[n]).abs().max().item() for n in want) > 1e-3
    assert not multiprocessing.active_children()


def test_a_failing_rank_raises_its_error_in_the_caller_and_leaves_no_process():
    with pytest.raises(RuntimeError, match="a data-parallel rank failed") as failed:
        train_data_parallel(Budget(learners=2, steps=4, warmup=5), 0, procs=2)
    assert "warmup_steps" in str(failed.value)
    assert not multiprocessing.active_children()
