"""What makes a delta acceptable: metadata claims, tensor shapes and values, norm outliers."""

import math

import pytest
import torch

from tasks.core.validate import (
    REQUIRED_METADATA,
    check_metadata,
    check_tensor,
    check_tensors,
    global_norm,
    norm_outliers,
)

RUN, LEARNER, PHASE, ROUND = "run-abc", "us-east-0", 4, 7


def meta(**changes) -> dict[str, str]:
    base = {
        "run": RUN,
        "learner": LEARNER,
        "region": "us-east",
        "phase": str(PHASE),
        "base_round": "6",
        "inner_steps": "50",
        "tokens": "102400",
        "loss": "2.5",
        "codec": "fp32",
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def check(m: dict[str, str]) -> str | None:
    return check_metadata(m, RUN, LEARNER, PHASE, ROUND)


# -- metadata -----------------------------------------------------------------------------------


def test_good_metadata_passes():
    assert check(meta()) is None
    assert check(meta(base_round=str(ROUND))) is None  # trained on the newest round
    assert check(meta(base_round="0")) is None


@pytest.mark.parametrize("field", REQUIRED_METADATA)
def test_each_missing_field_is_named(field):
    assert check(meta(**{field: None})) == f"metadata missing: {field}"


def test_all_missing_fields_are_listed():
    assert check({"run": RUN}) == "metadata missing: learner, region, phase, base_round, inner_steps, tokens, loss"


def test_wrong_run():
    reason = check(meta(run="run-other"))
    assert reason == "wrong run id 'run-other' (this run is 'run-abc')"


@pytest.mark.parametrize("changes", [{"learner": "eu-west-0"}, {"phase": "5"}])
def test_metadata_must_match_the_key(changes):
    reason = check(meta(**changes))
    assert reason is not None
    assert "but the key says us-east-0 phase 4" in reason
    assert reason.startswith(f"metadata names {changes.get('learner', LEARNER)} phase {changes.get('phase', PHASE)}")


def test_future_base_round():
    reason = check(meta(base_round=str(ROUND + 1)))
    assert reason == f"base round {ROUND + 1} is from the future (newest published round is {ROUND})"


@pytest.mark.parametrize(
    "field,value", [("phase", "four"), ("base_round", "6.0"), ("inner_steps", ""), ("tokens", "1e5"), ("loss", "low")]
)
def test_non_numeric(field, value):
    assert check(meta(**{field: value})) == "metadata not numeric where it must be"


@pytest.mark.parametrize("changes", [{"base_round": "-1"}, {"tokens": "0"}, {"tokens": "-5"}, {"inner_steps": "0"}])
def test_non_positive_counts(changes):
    assert check(meta(**changes)) == "base round, tokens and inner steps must be positive"


@pytest.mark.parametrize("loss", ["nan", "inf", "-inf"])
def test_non_finite_loss(loss):
    assert check(meta(loss=loss)) == "loss is not finite"


# -- tensors ------------------------------------------------------------------------------------


def reference() -> dict[str, torch.Tensor]:
    return {"wte.weight": torch.zeros(10, 4), "ln_f.weight": torch.zeros(4), "head.weight": torch.zeros(3, 4)}


def delta(**changes) -> dict[str, torch.Tensor]:
    out = {k: torch.full_like(v, 0.01) for k, v in reference().items()}
    out.update(changes)
    return {k: v for k, v in out.items() if v is not None}


def test_good_tensors_pass():
    assert check_tensors(delta(), reference()) is None
    assert check_tensors(delta(**{"ln_f.weight": torch.zeros(4, dtype=torch.float64)}), reference()) is None


def test_missing_tensor():
    reason = check_tensors(delta(**{"head.weight": None}), reference())
    assert reason == "wrong tensor names (unexpected [], missing ['head.weight'])"


def test_unexpected_tensor():
    reason = check_tensors(delta(extra=torch.zeros(1)), reference())
    assert reason == "wrong tensor names (unexpected ['extra'], missing [])"


def test_wrong_shape():
    reason = check_tensors(delta(**{"wte.weight": torch.zeros(4, 10)}), reference())
    assert reason == "wrong shape for wte.weight: (4, 10) instead of (10, 4)"


def test_wrong_dtype():
    reason = check_tensors(delta(**{"ln_f.weight": torch.zeros(4, dtype=torch.int64)}), reference())
    assert reason == "wrong dtype for ln_f.weight: torch.int64"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values(bad):
    t = torch.full((3, 4), 0.01)
    t[2, 1] = bad
    reason = check_tensors(delta(**{"head.weight": t}), reference())
    assert reason == "non-finite values (NaN or Inf) in head.weight"


def test_huge_finite_values_are_not_called_non_finite():
    """Their squares overflow float32, so the norm is taken again in float64."""
    t = torch.full((3, 4), 1e30)
    reason, norm = check_tensor("head.weight", t, reference()["head.weight"])
    assert reason is None and math.isclose(norm, 1e30 * math.sqrt(12), rel_tol=1e-6)


# -- norms --------------------------------------------------------------------------------------


def test_global_norm():
    assert global_norm([3.0, 4.0]) == 5.0
    norms = [check_tensor(name, t, reference()[name])[1] for name, t in delta().items()]
    assert math.isclose(global_norm(norms), 0.01 * math.sqrt(40 + 4 + 12), rel_tol=1e-6)


def test_norm_outliers_need_three():
    assert norm_outliers({}) == {}
    assert norm_outliers({"a": 1.0}) == {}
    assert norm_outliers({"a": 1.0, "b": 1000.0}) == {}


def test_norm_outliers_flag_a_hundredfold_delta_and_keep_the_others():
    norms = {"a": 1.0, "b": 1.2, "c": 0.9, "d": 100.0}
    out = norm_outliers(norms)
    assert set(out) == {"d"}
    assert "norm 100" in out["d"] and "median 1" in out["d"] and "×10" in out["d"]


def test_norm_outliers_flag_a_tiny_delta():
    out = norm_outliers({"a": 1.0, "b": 1.1, "c": 0.95, "z": 0.001})
    assert set(out) == {"z"}


def test_norm_outliers_keep_normal_spread():
    assert norm_outliers({"a": 1.0, "b": 3.0, "c": 0.4, "d": 2.0}) == {}
    # just inside and just outside the factor
    assert norm_outliers({"a": 1.0, "b": 1.0, "c": 1.0, "d": 10.0}) == {}
    assert set(norm_outliers({"a": 1.0, "b": 1.0, "c": 1.0, "d": 10.5})) == {"d"}
    assert set(norm_outliers({"a": 1.0, "b": 1.0, "c": 1.0, "d": 3.5}, factor=3.0)) == {"d"}


def test_norm_outliers_with_three_flag_only_the_outlier():
    assert set(norm_outliers({"a": 1.0, "b": 1.1, "c": 150.0})) == {"c"}


def test_norm_outliers_with_three_close_norms():
    assert norm_outliers({"a": 1.0, "b": 1.1, "c": 5.0}) == {}
