"""The checker's methods, diagnoses and gallery (issue 12).

Oracles: functions with known derivatives (``sin``, polynomials whose
truncation error is known in closed form), the complex step as the
reference for the other methods, and deliberately broken backwards whose
bug is known in advance (:mod:`qkvnp.gradcheck.gallery`): each must be
caught with its documented diagnosis, and its correct twin must pass.
"""
import numpy as np
import pytest

from qkvnp import MultiHeadAttention, SelfAttention
from qkvnp import functional as F
from qkvnp.gradcheck import (DIAGNOSES, METHODS, ORDERS, TOLERANCES, check_function,
                             check_layer, check_op)
from qkvnp.gradcheck.diagnosis import FORMS, diagnose, nearest_form
from qkvnp.gradcheck.gallery import CASES, run_case, run_gallery

FLOAT64 = np.dtype(np.float64)


def sin_vjp(dout, x):
    return {"x": np.cos(x) * dout}


# ---------------------------------------------------------------- methods


def test_every_method_has_an_order_and_a_float64_tolerance():
    assert METHODS == ("central", "central4", "richardson", "complex_step")
    assert ORDERS["central"] == "O(h^2)" and ORDERS["central4"] == "O(h^4)"
    assert set(ORDERS) == set(METHODS) == set(TOLERANCES[FLOAT64])


@pytest.mark.parametrize("method", ["central", "central4", "richardson"])
def test_truncation_order_of_each_stencil(method):
    # Oracle: for f = x^5 at x = 1 the truncation error is known in closed
    # form: central h^2 f'''/6 = 10 h^2, central4 -h^4 f^(5)/30 = -4 h^4.
    # Halving h divides it by 4 (central) or 16 (central4); Ridders' tableau
    # extrapolates it away. dout = 1/out-scale: the check's random dout is
    # read back from the report's analytic value.
    x = np.array([1.0])
    errors = []
    for h in (1e-2, 5e-3):
        report = check_function(lambda x: x ** 5, {"x": x}, lambda dout, x: {"x": 5 * x ** 4 * dout},
                                method=method, eps=h)
        row = report.row("x")
        errors.append(abs(row.numeric - row.analytic) / abs(row.analytic))
    if method == "central":
        assert errors[0] == pytest.approx(10 * 1e-2 ** 2 / 5, rel=1e-3)
        assert errors[0] / errors[1] == pytest.approx(4, rel=1e-3)
    elif method == "central4":
        assert errors[0] == pytest.approx(4 * 1e-2 ** 4 / 5, rel=1e-2)
        assert errors[0] / errors[1] == pytest.approx(16, rel=1e-2)
    else:
        assert max(errors) < 1e-13


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", ["elementwise", "direction"])
def test_every_method_passes_right_gradients_and_names_itself(method, mode, rng):
    inputs = {"query": rng.normal(size=(2, 3, 4)), "key": rng.normal(size=(2, 5, 4)),
              "value": rng.normal(size=(2, 5, 3))}
    report = check_op(F.attention_forward, F.attention_backward, inputs,
                      forward_kwargs={"is_causal": True}, method=method, mode=mode)
    assert report.ok, report.table()
    assert report.method == method and report.order == ORDERS[method]
    assert report.table().startswith(f"gradcheck ({method} {ORDERS[method]}, {mode}, float64")
    assert report.rtol == TOLERANCES[FLOAT64][method].rtol


@pytest.mark.parametrize("method", ["central4", "richardson"])
def test_higher_order_methods_pass_both_layers(method, rng, impl):
    x = rng.normal(size=(2, 3, 6))
    keep = rng.random((2, 3, 3)) < 0.7
    keep[..., 0] = True
    keep[0, -1] = False  # a fully masked row
    for layer, kwargs in ((SelfAttention(6, 4, qkv_bias=True, rng=1, impl=impl),
                           {"attn_mask": keep}),
                          (MultiHeadAttention(6, 2, rng=1, impl=impl), {"is_causal": True})):
        report = check_layer(layer, x, forward_kwargs=kwargs, method=method)
        assert report.ok, report.table()


def test_richardson_reports_its_error_estimate(rng):
    report = check_function(lambda x: np.sin(x), {"x": rng.normal(size=4)}, sin_vjp, method="richardson")
    estimate = report.error_estimates["x"]
    assert report.ok and 0 <= estimate < 1e-10
    # an estimate, not a bound: the error it made is of its order (measured
    # 2.8e-15 against an estimate of 2.3e-15; sin's analytic side is exact)
    assert report.row("x").max_abs_err <= 10 * max(estimate, 1e-15)


def test_float32_methods_and_their_tolerances(rng):
    x = rng.normal(size=(2, 3, 4))
    layer = MultiHeadAttention(4, 2, rng=0)
    for method in ("central", "central4", "richardson"):
        report = check_layer(layer, x, method=method, dtype=np.float32)
        assert report.ok and report.dtype == np.float32, report.table()
    with pytest.raises(ValueError, match="float64 only"):
        check_layer(layer, x, method="complex_step", dtype=np.float32)
    with pytest.raises(ValueError, match="method must be one of"):
        check_layer(layer, x, method="forward")


# ---------------------------------------------------------------- diagnosis


def test_nearest_forms_are_small_integers_their_roots_and_reciprocals():
    assert nearest_form(np.sqrt(2)) == "sqrt(2)" and nearest_form(1 / np.sqrt(8)) == "1/sqrt(8)"
    assert nearest_form(1 / 6) == "1/6" and nearest_form(16.0) == "16"
    assert nearest_form(1.5) is None and nearest_form(17.0) is None and nearest_form(0.0) is None
    assert "sqrt(4)" not in FORMS  # a root that is an integer is the integer


def test_diagnosis_codes_are_the_documented_set():
    assert set(DIAGNOSES) == {"nonfinite", "noise", "zero", "sign", "ratio", "transposed", "zero_slices",
                              "softmax_axis", "ones_dout", "rotation", "unknown"}


def zero_sum_noise(shape):
    noise = np.random.default_rng(1).normal(size=shape)
    return noise - noise.mean(axis=-1, keepdims=True)


@pytest.mark.parametrize("make, code", [
    (lambda n: n * np.sqrt(2), "ratio"),  # a missing sqrt(2)
    (lambda n: -n, "sign"),
    (lambda n: np.zeros_like(n), "zero"),
    (lambda n: np.swapaxes(n, -1, -2), "transposed"),
    (lambda n: np.where(np.arange(4)[:, None] == 2, 0.0, n), "zero_slices"),
    (lambda n: n + 1.0, "softmax_axis"),  # n's rows sum to 0, a's do not
    (lambda n: np.full_like(n, np.nan), "nonfinite"),
    (lambda n: n[..., ::-1], "rotation"),  # a permutation within rows keeps each row's length
    (lambda n: n + zero_sum_noise(n.shape), "unknown"),  # keeps the invariance: no pattern
    (lambda n: n + 1e-7 * zero_sum_noise(n.shape), "noise"),  # within 10 rtol normwise
])
def test_each_rule_on_a_planted_pattern(make, code):
    numeric = np.random.default_rng(0).normal(size=(4, 4))
    numeric -= numeric.mean(axis=-1, keepdims=True)  # rows sum to zero, like a softmax's input
    assert diagnose(make(numeric), numeric, 1e-6)[0] == code


def test_direction_mode_only_tells_ratios_and_signs():
    numeric = np.array([0.3, -1.2, 2.0])
    assert diagnose(-numeric, numeric, 1e-6, mode="direction")[0] == "sign"
    assert diagnose(2 * numeric, numeric, 1e-6, mode="direction")[1].startswith(
        "constant ratio analytic / numeric = 2 ~ 2")
    assert diagnose(numeric[::-1], numeric, 1e-6, mode="direction")[0] == "unknown"


def test_passing_rows_carry_no_diagnosis(rng):
    report = check_function(lambda x: np.sin(x), {"x": rng.normal(size=3)}, sin_vjp)
    assert report.ok and report.row("x").diagnosis is None and "diagnosis" not in report.table()


# ---------------------------------------------------------------- gallery


def test_the_gallery_has_the_issues_cases():
    names = [case.name for case in CASES]
    assert names == [
        "softmax over a single score", "scale by the embedding size",
        "softmax over the wrong axis", "softmax without the row-sum term",
        "mask polarity flipped in the backward", "broadcast bias gradient not summed",
        "dK transposed", "sign flip in the value gradient", "right only for dout = ones",
        "RoPE backward by +theta", "sink missing from the row sum",
        "LayerNorm backward without the mean term", "GELU derivative without the x d(tanh) part",
    ]
    assert all(case.diagnosis in DIAGNOSES for case in CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_each_broken_backward_is_caught_and_diagnosed(case):
    broken, correct = run_case(case)
    row = broken.row(case.row)
    assert not broken.ok and not row.ok, broken.table()
    assert row.diagnosis == case.diagnosis, broken.table()
    assert row.detail and row.detail in broken.table()
    assert correct.ok, correct.table()


def test_the_embedding_scale_bug_reads_as_one_over_sqrt_2():
    case = next(case for case in CASES if case.name == "scale by the embedding size")
    broken, _ = run_case(case)
    for name in ("query", "key"):
        assert "~ 1/sqrt(2)" in broken.row(name).detail
    assert broken.row("value").ok  # the value path has no scale


def test_run_gallery_prints_every_case(capsys):
    assert run_gallery() is True
    out = capsys.readouterr().out
    for number, case in enumerate(CASES, 1):
        assert f"{number}. {case.name}: " in out
    assert out.count("correct backward: OK") == len(CASES)
    assert "passed (missed!)" not in out


def test_a_constant_ratio_near_one_reads_as_a_common_relative_error():
    numeric = np.random.default_rng(0).normal(size=(3, 3))
    code, words = diagnose(numeric * (1 + 1e-10), numeric, 1e-12)
    assert code == "ratio" and "= 1 +1.00e-10: the same relative error in every entry" in words


# ---------------------------------------------------------------- the round-off floor


def test_the_default_floor_follows_the_round_off_model_at_embed_128():
    # `gradcheck --embed 128` failed: L = <dout, f> sums 1024 outputs, its
    # round-off over h = 1e-5 reaches 1e-9 (measured), which the constant floor
    # atol = 1e-3 turned into relative errors of 1.1e-6 on b_key, a gradient
    # that is zero in exact arithmetic. The default floor is now the model's
    # noise / (h rtol), noise = u sum|dout * f| / h: derived from the inputs.
    rng = np.random.default_rng(0)
    layer = MultiHeadAttention(128, 2, rng=0)
    layer.params["b_key"][...] = rng.normal(scale=0.5, size=128)
    # NOTE: inputs of scale 3 put the round-off error at 2.4-3.3e-9 on the
    # reference and fast paths, well above the constant floor's 1e-9 (scale 1
    # gave 0.6-1.1e-9 there, and whether it crossed 1e-9 depended on the
    # kernel's rounding), and still a fifth of the model's noise
    x = 3 * rng.normal(size=(2, 4, 128))

    def fun(b_key):
        layer.params["b_key"] = b_key
        return layer.forward(x)

    def vjp(dout, b_key):
        layer.params["b_key"] = b_key
        layer.zero_grad()
        layer.forward(x)
        layer.backward(dout)
        return {"b_key": layer.grads["b_key"]}

    point = {"b_key": layer.params["b_key"].copy()}
    report = check_function(fun, point, vjp)
    dout = np.random.default_rng(0).standard_normal((2, 4, 128))  # the check's draw
    out = fun(point["b_key"].copy())
    noise = 2.0 ** -53 * np.sum(np.abs(dout * out)) / 1e-5
    assert report.round_off == pytest.approx(noise, rel=1e-9)
    assert report.atol == pytest.approx(max(1e-3, noise / 1e-6)) and report.atol > 1e-3
    assert report.ok and report.row("b_key").max_abs_err < noise, report.table()
    # the old constant floor: fails, and the diagnosis says why
    constant = check_function(fun, point, vjp, atol=1e-3)
    assert not constant.ok and constant.row("b_key").diagnosis == "noise", constant.table()
