"""What makes a delta acceptable: every metadata field against its bounds, tensor shapes and
values, key forms, and the norm limit."""

import math

import pytest
import torch

from islands.core.validate import (
    MAX_REASON,
    METADATA,
    REQUIRED_METADATA,
    Expected,
    Invalid,
    check_tensor,
    check_tensors,
    claimed_tokens,
    global_norm,
    norm_bound,
    norm_outliers,
    read_claims,
    read_field,
    short,
)
from islands.storage import layout

RUN, LEARNER, REGION, PHASE, ROUND, H, PER_STEP = "run-abc", "us-east-0", "us-east", 4, 7, 50, 2048
EXPECTED = Expected(RUN, LEARNER, REGION, PHASE, ROUND, H, PER_STEP)


def meta(**changes) -> dict[str, str]:
    base = {
        "run": RUN,
        "learner": LEARNER,
        "region": REGION,
        "phase": str(PHASE),
        "base_round": "6",
        "start_round": "5",
        "rebases": "10:6",
        "inner_steps": "50",
        "tokens": str(50 * PER_STEP),
        "loss": "2.500000",
        "seconds": "12.250",
        "finished_at": "1780000000.125",
        "io_read": "123",
        "io_read_global": "100",
        "io_written": "456",
        "codec": "fp32",
        "body_sha256": "ab" * 32,
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def check(m: dict) -> str | None:
    try:
        read_claims(m, EXPECTED)
    except Invalid as exc:
        return str(exc)
    return None


# -- metadata -----------------------------------------------------------------------------------


def test_good_metadata_passes_and_is_read():
    claims = read_claims(meta(), EXPECTED)
    assert (claims.base_round, claims.inner_steps, claims.tokens) == (6, 50, 50 * PER_STEP)
    assert (claims.loss, claims.seconds, claims.finished_at) == (2.5, 12.25, 1780000000.125)
    assert check(meta(base_round=str(ROUND), start_round=None)) is None  # trained on the newest round
    assert check(meta(base_round="0", start_round="0", rebases="")) is None
    optional = [k for k, f in METADATA.items() if not f.required]
    assert check(meta(**dict.fromkeys(optional))) is None


def test_every_field_the_learner_writes_is_known():
    """What a learner writes (tasks.train_phase) is exactly what the bounds cover."""
    assert set(meta()) == set(METADATA)


# Every kind of bad value, for the kinds of field it applies to.
BAD = {
    "not a number": ("int", "float", "abc"),
    "empty": ("int", "float", "text", "codec", "sha256", ""),
    "nan": ("int", "float", "nan"),
    "inf": ("int", "float", "inf"),
    "-inf": ("int", "float", "-inf"),
    "negative": ("int", "float", "-1"),
    "huge": ("int", "float", "9" * 400),
    "beyond int64": ("int", "float", str(2**64)),
    "huge exponent": ("int", "float", "1e999"),
    "python-only spelling": ("int", "float", "1_000"),
    "padded": ("int", "float", " 5"),
    "non-ASCII digits": ("int", "float", "\u0663"),
    "hex": ("int", "0x10"),
    "fraction": ("int", "2.5"),
    "leading zeros": ("int", "007"),
    "overlong": ("text", "codec", "sha256", "x" * 10_000),
    "non-ASCII": ("text", "codec", "sha256", "r\u00fcn-\u0430bc"),
    "control characters": ("text", "codec", "sha256", "run-abc\n"),
}
CASES = [
    pytest.param(name, value, id=f"{name}-{kind}")
    for name, f in METADATA.items()
    for kind, (*kinds, value) in BAD.items()
    if f.kind in kinds and (name, value) != ("rebases", "")  # no rebase in the phase: empty
]


@pytest.mark.parametrize("name,value", CASES)
def test_every_field_refuses_every_kind_of_bad_value(name, value):
    reason = check(meta(**{name: value}))
    assert reason is not None, (name, value)
    assert name in reason or "wrong run id" in reason or "metadata names" in reason, reason
    assert len(reason) <= MAX_REASON and reason.isascii() and "\n" not in reason, reason
    assert read_field(meta(**{name: value}), name, "default") == "default"


@pytest.mark.parametrize("name", sorted(METADATA))
@pytest.mark.parametrize("value", [5, 2.5, None, ["1"], {"a": "1"}, b"1"])
def test_every_field_refuses_a_value_that_is_not_a_string(name, value):
    m = meta()
    m[name] = value
    reason = check(m)
    assert reason is not None and name in reason and "not a string" in reason


@pytest.mark.parametrize("field", REQUIRED_METADATA)
def test_each_missing_field_is_named(field):
    assert check(meta(**{field: None})) == f"metadata missing: {field}"


def test_unknown_fields_are_refused_and_not_copied_whole():
    reason = check({**meta(), "x" * 5000: "1"})
    assert reason.startswith("unknown metadata field") and len(reason) < 80


def test_wrong_run():
    assert check(meta(run="run-other")) == "wrong run id 'run-other' (this run is 'run-abc')"


@pytest.mark.parametrize("changes", [{"learner": "eu-west-0"}, {"phase": "5"}, {"learner": "us-east-00"}])
def test_the_key_owner_is_the_learner(changes):
    reason = check(meta(**changes))
    assert reason is not None and "but the key says us-east-0 phase 4" in reason


def test_region_must_be_the_owners():
    assert "us-east-0 is of us-east" in check(meta(region="eu-west"))


def test_future_rounds_and_steps_beyond_h():
    assert check(meta(base_round=str(ROUND + 1), start_round="0")) == (
        f"base round {ROUND + 1} is from the future (newest published round is {ROUND})"
    )
    assert "after its base round" in check(meta(start_round="7"))
    assert check(meta(inner_steps=str(H + 1))) == f"inner steps {H + 1} > H = {H}"


@pytest.mark.parametrize("changes", [{"tokens": "0"}, {"inner_steps": "0"}])
def test_non_positive_counts(changes):
    assert "outside [1" in check(meta(**changes))


@pytest.mark.parametrize("claim", [50 * PER_STEP + 1, 10**9, 2**53])
def test_token_claims_are_capped_at_what_the_steps_hold(claim):
    assert read_claims(meta(tokens=str(claim)), EXPECTED).tokens == 50 * PER_STEP
    assert read_claims(meta(tokens=str(claim), inner_steps="3"), EXPECTED).tokens == 3 * PER_STEP
    assert claimed_tokens(meta(tokens=str(claim), inner_steps=str(10**6)), H, PER_STEP) == H * PER_STEP
    assert claimed_tokens(meta(tokens="lots"), H, PER_STEP) == 0


def test_short_reasons_are_bounded_ascii_and_stable():
    reason = short("bad \u202e\x00\n θ " + "y" * 10_000)
    assert len(reason) == MAX_REASON and reason.startswith("bad ??? θ yy") and reason.endswith("y...")
    assert short(reason) == reason


# -- keys ---------------------------------------------------------------------------------------

KEY = layout.delta_key(RUN, LEARNER, PHASE)


def test_a_delta_key_has_one_spelling():
    assert layout.parse_delta_key(KEY) == (LEARNER, PHASE)
    assert layout.parse_delta_key(layout.delta_key(RUN, LEARNER, 1_234_567)) == (LEARNER, 1_234_567)


ALIASES = [
    KEY.upper(),
    KEY.replace("us-east-0", "US-east-0"),
    KEY.replace("/deltas/", "/deltas//"),
    KEY.replace("/deltas/", "//deltas/"),
    "/" + KEY,
    "x/" + KEY,
    KEY.replace("/deltas/", "/deltas/./"),
    KEY.replace("/deltas/", "/deltas/x/../"),
    f"runs/{RUN}/deltas/x/runs/{RUN}/deltas/{LEARNER}/000004.safetensors",
    KEY.replace("000004", "0000004"),
    KEY.replace("000004", "00000004"),
    KEY.replace("000004", "00000\u0664"),  # ARABIC-INDIC DIGIT FOUR
    KEY.replace("000004", "00000\uff14"),  # FULLWIDTH DIGIT FOUR
    KEY.replace("us-east-0", "us-east-\u0660"),
    KEY.replace("us-east-0", "us-\u0435ast-0"),  # Cyrillic e
    KEY.replace("us-east-0", "us-east-00"),
    KEY.replace("us-east-0", "us-east-+0"),
    KEY + "\n",
    KEY + "/",
    KEY.replace(".safetensors", ".SAFETENSORS"),
    KEY.replace(".safetensors", ".safetensors.bak"),
    KEY.replace("000004", " 000004"),
    KEY.replace("000004", "-00004"),
]


@pytest.mark.parametrize("key", ALIASES)
def test_no_other_form_of_a_key_parses(key):
    assert layout.parse_delta_key(key) is None, key


def test_distinct_keys_never_name_the_same_learner_and_phase():
    parsed = {}
    for key in [KEY, *ALIASES, layout.delta_key(RUN, "us-east-1", PHASE), layout.delta_key(RUN, LEARNER, 5)]:
        p = layout.parse_delta_key(key)
        if p is not None:
            assert p not in parsed, (key, parsed[p])
            parsed[p] = key
    assert len(parsed) == 3


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
    assert reason == "wrong tensor names (unexpected 0: -; missing 1: head.weight)"


def test_unexpected_tensor():
    reason = check_tensors(delta(extra=torch.zeros(1)), reference())
    assert reason == "wrong tensor names (unexpected 1: 'extra'; missing 0: -)"


def test_many_long_tensor_names_are_not_copied_whole():
    reason = check_tensors(delta(**{"x" * 10_000 + str(i): torch.zeros(1) for i in range(1000)}), reference())
    assert reason.startswith("wrong tensor names (unexpected 1000: 'xxx") and len(reason) < 200


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


def refused(norms: dict[str, float], history=(), model_norm=1e9, limit=10.0) -> set[str]:
    """The deltas either rule refuses: each delta's bound, then the round's outliers."""
    out = {k for k, n in norms.items() if norm_bound(n, list(history), model_norm, limit)}
    return out | set(norm_outliers({k: n for k, n in norms.items() if k not in out}, limit))


@pytest.mark.parametrize("n", [1, 2])
def test_an_enormous_delta_is_refused_alone_or_with_one_other(n):
    """With one or two deltas the round's median tells nothing: the model's norm and the run's
    history bound them."""
    norms = dict(list({"huge": 1e30, "ok": 1.0}.items())[:n])
    assert refused(norms, model_norm=40.0) == {"huge"}
    assert refused(norms, history=[1.0, 1.2]) == {"huge"}
    big = dict(list({"big": 50.0, "ok": 1.0}.items())[:n])
    assert refused(big, model_norm=40.0) == {"big"}
    assert refused(big, history=[1.0, 1.1, 0.9], model_norm=1e9) == {"big"}
    assert refused({"ok": 9.9}, history=[1.0], model_norm=40.0) == set()


def test_the_first_round_is_bounded_by_the_model_only():
    assert refused({"a": 39.0}, model_norm=40.0) == set()
    assert refused({"a": 41.0}, model_norm=40.0) == {"a"}


def test_reasons_say_which_bound():
    assert "model's own norm" in norm_bound(100.0, [0.4], 60.0, 10.0)
    assert "recently merged" in norm_bound(5.0, [0.4], 60.0, 10.0)
    assert norm_bound(3.0, [0.4], 60.0, 10.0) is None


def test_round_outliers_need_three():
    assert refused({}) == set()
    assert refused({"a": 1.0, "b": 1000.0}) == set()


def test_round_outliers_flag_a_hundredfold_delta_and_keep_the_others():
    out = norm_outliers({"a": 1.0, "b": 1.2, "c": 0.9, "d": 100.0}, 10.0)
    assert set(out) == {"d"}
    assert "norm 100" in out["d"] and "median 1" in out["d"] and "×10" in out["d"]


def test_round_outliers_flag_a_tiny_delta():
    assert refused({"a": 1.0, "b": 1.1, "c": 0.95, "z": 0.001}) == {"z"}


def test_round_outliers_keep_normal_spread():
    assert refused({"a": 1.0, "b": 3.0, "c": 0.4, "d": 2.0}) == set()
    # just inside and just outside the factor
    assert refused({"a": 1.0, "b": 1.0, "c": 1.0, "d": 10.0}) == set()
    assert refused({"a": 1.0, "b": 1.0, "c": 1.0, "d": 10.5}) == {"d"}
    assert refused({"a": 1.0, "b": 1.0, "c": 1.0, "d": 3.5}, limit=3.0) == {"d"}
    assert refused({"a": 1.0, "b": 1.1, "c": 150.0}) == {"c"}
    assert refused({"a": 1.0, "b": 1.1, "c": 5.0}) == set()
