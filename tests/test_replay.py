"""The schedule replay is the synchronous algorithm when nothing is slow or late: equal learners
whose rounds are visible at once give synchronous DiLoCo's model bit for bit, with or without carry
(there is never an unmerged delta to carry). Latency is what separates the learner behaviours."""

import torch

from benchmarks.inprocess import Budget, sync_diloco
from benchmarks.replay import Schedule, replay
from tasks.merge import MergeRule

RULE = MergeRule(outer_lr=0.7, outer_momentum=0.9)
BUDGET = Budget(steps=4, warmup=1)


def test_equal_learners_and_no_latency_replay_synchronous_diloco_exactly():
    torch.set_num_threads(1)
    sync = sync_diloco(BUDGET, 0, 2, RULE)
    for carry in (False, True):
        theta, facts = replay(BUDGET, Schedule(2, speeds=(1, 1, 1, 1), publish_s=0.0, carry=carry), RULE)
        assert facts["rounds"] == 2 and facts["deltas_per_round"] == 4 and facts["mean_staleness"] == 0
        assert all(torch.equal(theta[n], sync[n]) for n in sync)
    late, _ = replay(BUDGET, Schedule(2, speeds=(1, 1, 1, 1), publish_s=1.0), RULE)
    assert not all(torch.equal(late[n], sync[n]) for n in sync)
