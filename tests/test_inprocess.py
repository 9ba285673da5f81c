"""Synchronous DiLoCo with its learners in worker processes is the serial loop at one thread, bit for
bit, every round; a worker that fails raises in the caller and leaves no process behind."""

import multiprocessing

import pytest
import torch

from benchmarks.inprocess import Budget, sync_diloco
from tasks.merge import MergeRule

RULE = MergeRule(outer_lr=0.7, outer_momentum=0.9)
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


@pytest.mark.parametrize("budget, init", [
    (Budget(steps=4, warmup=5), None),  # the workers fail building their trainers
    (BUDGET, {"no such weight": torch.zeros(1)}),  # they fail in the first phase
], ids=["building", "training"])
def test_a_failing_worker_raises_its_error_in_the_caller_and_leaves_no_process(budget, init):
    with pytest.raises(RuntimeError, match="a learner worker failed") as failed:
        sync_diloco(budget, 0, 2, RULE, init=init, procs=2)
    assert ("warmup_steps" if init is None else "load_state_dict") in str(failed.value)
    assert not multiprocessing.active_children()
