"""The WAN planner against published figures, and its arithmetic on cases worked by hand."""

import pytest

from flows.cli import main
from tasks.core.plan import (
    PAPER_DILOCO_GBPS,
    PAPER_DP_GBPS,
    Workload,
    data_parallel_gbps,
    decoupled_gbps,
    diloco_gbps,
    published_checks,
    ring_bytes,
    transfer_s,
)


def test_one_trillion_parameters_take_about_8000_seconds_over_2_gbps():
    assert transfer_s(1e12 * 2, 2.0) == pytest.approx(8000, rel=0.01)


def test_streaming_diloco_ratio_of_data_parallel_to_diloco_at_h100_within_5_percent():
    w = Workload(params=10e9, step_s=0.8, inner_steps=100, utilization=0.95)
    assert data_parallel_gbps(w) / diloco_gbps(w) == pytest.approx(PAPER_DP_GBPS / PAPER_DILOCO_GBPS, rel=0.05)


def test_every_published_check_holds_or_says_it_cannot_be_reproduced():
    checks = published_checks()
    assert [c.holds for c in checks] == [True, True, None]
    assert "not reproducible" in checks[-1].note and checks[-1].ours is None


def test_ring_all_reduce_bytes():
    assert ring_bytes(100.0, 1) == 0
    assert ring_bytes(100.0, 2) == 100
    assert ring_bytes(100.0, 4) == 150


def test_hand_worked_case():
    # 1e9 params, 1 s steps, K=2, u=0.5 (slack 1 s per s), no backward overlap.
    w = Workload(
        params=1e9,
        step_s=1.0,
        inner_steps=10,
        replicas=2,
        utilization=0.5,
        backward_share=0.0,
        grad_bits=16,
        delta_bits=4,
        checkpoint_bits=4,
        overlap_steps=0,
    )
    assert data_parallel_gbps(w) == pytest.approx(16.0)  # 2 GB = 16 Gbit each step, 1 s to hide it
    assert diloco_gbps(w) == pytest.approx(1.6)  # the same every 10 steps
    assert decoupled_gbps(w) == pytest.approx(0.8)  # 0.5 + 0.5 GB per phase, 10 s of slack
    more_overlap = Workload(**{**w.__dict__, "overlap_steps": 10})
    assert decoupled_gbps(more_overlap) == pytest.approx(0.4)


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match="utilization"):
        Workload(params=1e9, step_s=1.0, utilization=1.0)
    with pytest.raises(ValueError, match="link bandwidth"):
        transfer_s(1.0, 0)


def test_cli_plan_and_check_print_the_figures(capsys):
    assert main(["plan", "--check"]) == 0
    out = capsys.readouterr().out
    assert "8000" in out and "not reproducible" in out and "NO" not in out
    assert main(["plan", "--params", "1e9", "--step-time", "0.5", "--inner-steps", "50"]) == 0
    out = capsys.readouterr().out
    assert all(s in out for s in ("data-parallel", "diloco", "decoupled", "checkpoint"))
    assert main(["plan", "--replicas", "0"]) == 2
