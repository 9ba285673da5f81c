"""The WAN planner against published figures, and its arithmetic on cases worked by hand."""

from dataclasses import replace

import pytest

from islands.core.plan import (
    PAPER_DILOCO_GBPS,
    PAPER_DP_GBPS,
    Workload,
    data_parallel_gbps,
    decoupled_gbps,
    diloco_gbps,
    published_checks,
    ring_bytes,
    streamed,
    transfer_s,
)
from islands.flows.cli import main


def test_one_trillion_parameters_take_about_8000_seconds_over_2_gbps():
    assert transfer_s(1e12 * 2, 2.0) == pytest.approx(8000, rel=0.01)


def test_streaming_diloco_ratio_of_data_parallel_to_diloco_at_h100_within_5_percent():
    w = Workload(params=10e9, step_s=0.8, inner_steps=100, utilization=0.95)
    assert data_parallel_gbps(w) / diloco_gbps(w) == pytest.approx(PAPER_DP_GBPS / PAPER_DILOCO_GBPS, rel=0.05)


def test_every_published_check_holds_or_says_it_cannot_be_reproduced():
    checks = published_checks()
    assert [c.holds for c in checks] == [True, True, True, True, None]
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
    assert main(["plan", "--fragments", "4", "--overlap", "5"]) == 0
    assert "streamed, F=4: peak" in capsys.readouterr().out
    assert main(["plan", "--fragments", "0"]) == 2


def test_streamed_schedule_one_fragment_is_the_decoupled_scheme():
    w = Workload(params=1e9, step_s=0.5, inner_steps=100, overlap_steps=20)
    assert streamed(w, 1).peak_gbps == pytest.approx(decoupled_gbps(w))
    assert streamed(w, 1).in_flight == 1


def test_streamed_hand_worked_case():
    # 1e9 params, 4 + 4 bits a value a phase (1 GB), 1 s steps, H=10, u=0.5 (slack 1 s per s).
    w = Workload(params=1e9, step_s=1.0, inner_steps=10, utilization=0.5, delta_bits=4, checkpoint_bits=4)
    two = streamed(replace(w, overlap_steps=0), 2)  # 0.5 GB every 5 steps, 5 s of slack each
    assert two.fragment_bytes == pytest.approx(0.5e9)
    assert (two.in_flight, two.peak_gbps) == (1, pytest.approx(0.8))
    assert two.mean_gbps == pytest.approx(0.4)  # 8 Gbit over 10 steps and their 10 s of slack
    late = streamed(replace(w, overlap_steps=6), 2)  # a 6 + 5 s window outlasts the 5-step slot
    assert (late.in_flight, late.peak_gbps) == (2, pytest.approx(8 / 11))


def test_streamed_peak_falls_with_the_fragment_and_the_mean_does_not_move():
    """While a fragment's window fits in its slot (τ plus slack <= H/F steps); beyond, the
    transfers overlap and the peak climbs again."""
    w = Workload(params=1e9, step_s=0.5, inner_steps=100, overlap_steps=5)
    plans = [streamed(w, f) for f in (1, 2, 4, 10)]
    peaks = [p.peak_gbps for p in plans]
    assert peaks == sorted(peaks, reverse=True)
    assert {round(p.mean_gbps, 9) for p in plans} == {round(plans[0].mean_gbps, 9)}
    assert streamed(w, 20).in_flight == 2 and streamed(w, 20).peak_gbps > plans[-1].peak_gbps
    with pytest.raises(ValueError, match="fragments"):
        streamed(w, 101)
