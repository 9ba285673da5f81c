import random

import pytest
import torch

from islands.core.config import MergeSettings
from islands.core.merge import Candidate, Dropped, Weighted, outer_step, plan_merge, weighted_average

RULE = MergeSettings(outer_lr=0.5, outer_momentum=0.9, staleness_lambda=0.5, max_staleness=4, token_cap=2.0)
A = Candidate("a", phase=3, base_round=10, tokens=1000)  # fresh
B = Candidate("b", phase=2, base_round=9, tokens=1000)  # one round stale
C = Candidate("c", phase=5, base_round=10, tokens=10_000)  # claims 10× its peers
D = Candidate("d", phase=1, base_round=5, tokens=1000)  # five rounds stale
E = Candidate("e", phase=7, base_round=11, tokens=1000)  # based on a round not published yet


def test_hand_computed_round():
    weighted, dropped = plan_merge(10, [E, C, D, B, A], RULE)
    # a: others' median (1000 + 10000) / 2 = 5500, cap 11000, keeps 1000; weight 1000 / (1 + 0) = 1000
    # b: same cap, keeps 1000; weight 1000 / (1 + 0.5) = 666.67
    # c: others' median 1000, cap 2000 -> counts 2000; weight 2000
    assert weighted == [
        Weighted(A, staleness=0, tokens_counted=1000, weight=1000.0),
        Weighted(B, staleness=1, tokens_counted=1000, weight=1000 / 1.5),
        Weighted(C, staleness=0, tokens_counted=2000, weight=2000.0),
    ]
    assert all(type(w.weight) is float for w in weighted)
    assert dropped == [
        Dropped(D, "stale: staleness 5 > max 4"),
        Dropped(E, "base round from the future: base_round 11 > round 10"),
    ]

    deltas = {
        "a": torch.tensor([1.0, 0.0, 3.0]),
        "b": torch.tensor([4.0, 3.0, 0.0]),
        "c": torch.tensor([-1.0, 6.0, 0.0]),
    }
    merged = weighted_average([deltas[w.candidate.learner] for w in weighted], [w.weight for w in weighted])
    # Weights ∝ 3 : 2 : 6 -> (3·g_a + 2·g_b + 6·g_c) / 11
    assert merged.dtype == torch.float32
    assert torch.allclose(merged, torch.tensor([5 / 11, 42 / 11, 9 / 11]), rtol=1e-7, atol=0)


def test_no_cap_with_a_single_candidate_and_median_of_an_even_count():
    liar = Candidate("z", 0, 3, 10**9)
    assert plan_merge(3, [liar], RULE)[0] == [Weighted(liar, 0, 10**9, 10**9 / 1.0)]
    peers = [Candidate(n, 0, 3, t) for n, t in [("p", 100), ("q", 300), ("r", 400), ("s", 10_000)]]
    weighted, _ = plan_merge(3, peers, RULE)
    # s: others 100, 300, 400 -> median 300 -> cap 600. r: others 100, 300, 10000 -> median 300, cap 600 keeps 400.
    assert [w.tokens_counted for w in weighted] == [100, 300, 400, 600]


def test_zero_token_claims_are_dropped_and_staleness_at_the_maximum_is_kept():
    empty = Candidate("a", 1, 6, 0)
    oldest = Candidate("b", 1, 2, 500)
    weighted, dropped = plan_merge(6, [empty, oldest], RULE)
    assert dropped == [Dropped(empty, "no tokens: claims 0")]
    assert weighted == [Weighted(oldest, 4, 500, 500 / 3.0)]


def test_duplicate_candidates_are_refused():
    with pytest.raises(ValueError, match="duplicate"):
        plan_merge(10, [A, A], RULE)


def test_merge_rule_validates():
    with pytest.raises(ValueError, match=r"(?s)MergeSettings.*token_cap"):
        MergeSettings(token_cap=0.5)
    with pytest.raises(ValueError, match=r"(?s)MergeSettings.*outer_momentum"):
        MergeSettings(outer_momentum=1.0)


def test_merge_replays_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    candidates = [Candidate(f"l{i}", i, 10 - i % 3, 1000 + 37 * i) for i in range(6)]
    deltas = {c.learner: torch.randn(64, 33, generator=gen) for c in candidates}

    def merge(order):
        weighted, _ = plan_merge(10, order, RULE)
        return weighted_average([deltas[w.candidate.learner] for w in weighted], [w.weight for w in weighted])

    shuffled = candidates[:]
    random.Random(1).shuffle(shuffled)
    first, again, from_shuffled = merge(candidates), merge(candidates), merge(shuffled)
    assert torch.equal(first, again) and torch.equal(first, from_shuffled)


def test_weighted_average_accumulates_in_float64():
    big, small = torch.tensor([1e8], dtype=torch.float32), torch.tensor([1.0], dtype=torch.float32)
    # In float32, 1e8 + 1 - 1e8 == 0; in float64 the 1 survives until the final division.
    merged = weighted_average([big, small, -big], [1.0, 1.0, 1.0])
    assert merged.item() == pytest.approx(1 / 3, rel=1e-7)


def test_weighted_average_errors():
    with pytest.raises(ValueError, match="one weight per tensor"):
        weighted_average([torch.zeros(2)], [1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        weighted_average([torch.zeros(2)], [0.0])
    with pytest.raises(ValueError, match="shapes"):
        weighted_average([torch.zeros(2), torch.zeros(3)], [1.0, 1.0])


def test_outer_step_matches_torch_sgd_nesterov():
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(5, 7, generator=gen)
    deltas = [torch.randn(5, 7, generator=gen) for _ in range(3)]
    lr, mu = 0.7, 0.9

    reference = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([reference], lr=lr, momentum=mu, nesterov=True)
    param, momentum = start.clone(), None
    for delta in deltas:
        reference.grad = delta.clone()
        sgd.step()
        delta_before = delta.clone()
        param_before = param.clone()
        new_param, momentum = outer_step(param, momentum, delta, lr, mu)
        assert torch.equal(delta, delta_before) and torch.equal(param, param_before)  # pure
        param = new_param
        assert torch.equal(param, reference.detach())
        assert torch.equal(momentum, sgd.state[reference]["momentum_buffer"])


def test_outer_step_first_step_by_hand():
    param, momentum = outer_step(torch.tensor([1.0]), None, torch.tensor([0.5]), lr=0.5, mu=0.9)
    # m = Δ = 0.5; θ = 1 − 0.5·(0.5 + 0.9·0.5) = 0.525
    assert momentum.item() == 0.5 and param.item() == pytest.approx(0.525)
    param, momentum = outer_step(param, momentum, torch.tensor([0.5]), lr=0.5, mu=0.9)
    # m = 0.9·0.5 + 0.5 = 0.95; θ = 0.525 − 0.5·(0.5 + 0.855) = −0.1525
    assert momentum.item() == pytest.approx(0.95) and param.item() == pytest.approx(-0.1525)
