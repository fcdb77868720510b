"""The gradient checker itself: it passes right gradients and catches wrong ones.

Oracles: hand-written functions with known gradients (``x**2`` -> ``2x``),
and deliberately broken backwards whose defect is known in advance (a softmax
backward without the row-sum term, a transposed weight gradient, a gradient
off by a factor, one wrong entry): the checker must report failure on the
right row at the right index. A checker that cannot fail is worthless.
"""
import json
import re
import subprocess
import sys

import numpy as np
import pytest

import qkvnp.apps.cli
from qkvnp import MultiHeadAttention, SelfAttention
from qkvnp import functional as F
from qkvnp.gradcheck import (
    METHODS,
    TOLERANCES,
    GradcheckError,
    GradcheckReport,
    check_function,
    check_layer,
    check_op,
)

FLOAT64 = np.dtype(np.float64)
FLOAT32 = np.dtype(np.float32)


def square(x):
    return x ** 2


def square_vjp(dout, x):
    return {"x": 2 * x * dout}


def bad_softmax_backward(dweights, cache):
    """Softmax backward missing the row-sum term: ``P * dP`` instead of ``P * (dP - <P, dP>)``."""
    return cache.weights * dweights


def transposed_linear_backward(dout, cache):
    """Linear backward whose ``dW`` is transposed (only visible when ``W`` is square)."""
    dx, dW, db = F.linear_backward(dout, cache)
    return dx, dW.T, db


def unscaled_attention_backward(dout, cache):
    """Attention backward that forgets the scale in ``dquery`` (off by a factor 1/scale)."""
    dquery, dkey, dvalue = F.attention_backward(dout, cache)
    return dquery / cache.scale, dkey, dvalue


@pytest.fixture
def attention_inputs(rng):
    return {"query": rng.normal(size=(2, 3, 4)), "key": rng.normal(size=(2, 5, 4)),
            "value": rng.normal(size=(2, 5, 3))}


# ---------------------------------------------------------------- the table of tolerances


def test_tolerance_table_is_keyed_by_dtype_and_method_and_certifies_1e_6_in_float64():
    assert set(TOLERANCES) == {FLOAT64, FLOAT32}
    assert set(TOLERANCES[FLOAT64]) == set(METHODS)
    assert set(TOLERANCES[FLOAT32]) == set(METHODS) - {"complex_step"}  # complex128 only
    for dtype in TOLERANCES:
        for tol in TOLERANCES[dtype].values():
            assert tol.eps > 0 and tol.rtol > 0 and (tol.atol > 0 or tol.floor > 0)
    assert TOLERANCES[FLOAT64]["central"].rtol <= 1e-6
    # the higher-order methods certify more than central differences can
    assert TOLERANCES[FLOAT64]["complex_step"].rtol <= 1e-12
    assert TOLERANCES[FLOAT64]["central4"].rtol < TOLERANCES[FLOAT64]["central"].rtol
    # float32 is coarser than float64, never finer
    assert TOLERANCES[FLOAT32]["central"].rtol > TOLERANCES[FLOAT64]["central"].rtol


# ---------------------------------------------------------------- right gradients pass


@pytest.mark.parametrize("mode", ["elementwise", "direction"])
def test_known_gradient_of_square_passes(mode):
    # Oracle: d(x^2)/dx = 2x, exactly.
    x = np.array([[1.0, -2.0, 3.0], [0.5, 0.25, -4.0]])
    report = check_function(square, {"x": x}, square_vjp, mode=mode)
    assert isinstance(report, GradcheckReport)
    assert report.ok and report.mode == mode and report.dtype == FLOAT64
    row = report.row("x")
    assert row.shape == (2, 3) and row.ok
    assert row.max_rel_err <= 1e-9  # x^2 has no third derivative: round-off only
    np.testing.assert_array_equal(x, [[1.0, -2.0, 3.0], [0.5, 0.25, -4.0]])  # input untouched


def test_elementwise_numeric_values_match_the_known_gradient():
    # The analytic and numeric values shown at the worst index are the gradient.
    x = np.array([0.3, -1.7, 2.2])
    rng = np.random.default_rng(3)
    report = check_function(lambda x: np.sin(x), {"x": x},
                            lambda dout, x: {"x": np.cos(x) * dout}, rng=rng)
    dout = np.random.default_rng(3).standard_normal(3)  # the same draw
    row = report.row("x")
    assert row.analytic == pytest.approx((np.cos(x) * dout)[row.worst_index], rel=1e-14)
    assert row.numeric == pytest.approx(row.analytic, rel=1e-8)


@pytest.mark.parametrize("mode", ["elementwise", "direction"])
def test_functional_ops_pass(mode, attention_inputs, rng):
    report = check_op(F.attention_forward, F.attention_backward, attention_inputs,
                      forward_kwargs={"is_causal": True}, mode=mode)
    assert [row.name for row in report.rows] == ["query", "key", "value"]
    assert report.ok, report.table()
    # linear without bias: backward's trailing db=None is accepted
    inputs = {"x": rng.normal(size=(4, 3)), "W": rng.normal(size=(3, 2))}
    assert check_op(F.linear_forward, F.linear_backward, inputs, mode=mode).ok


def test_exactly_zero_gradient_passes_thanks_to_the_floor():
    # Oracle: b_key never changes the output (softmax ignores q . b_key, the
    # same for every key of a row): its analytic gradient is exactly 0 and
    # the numeric one is round-off. Only the absolute floor lets it pass.
    layer = MultiHeadAttention(4, 2, rng=1)
    layer.params["b_key"][...] = np.random.default_rng(2).normal(size=4)
    x = np.random.default_rng(3).normal(size=(2, 3, 4))
    report = check_layer(layer, x)
    row = report.row("param b_key")
    assert report.ok, report.table()
    assert abs(row.analytic) < 1e-14  # the largest |analytic| entry (the layer's grads untouched)
    assert row.numeric != 0.0 and abs(row.numeric) < 1e-9  # measured ~1e-10
    no_floor = check_layer(layer, x, atol=0.0)
    assert not no_floor.ok and not no_floor.row("param b_key").ok
    # round-off against round-off: the relative error is total, ~1
    assert no_floor.row("param b_key").max_rel_err == pytest.approx(1.0, abs=1e-3)
    assert all(r.ok for r in no_floor.rows if r.name != "param b_key")


def test_check_layer_restores_params_and_leaves_inputs_alone(rng):
    layer = SelfAttention(3, 2, qkv_bias=True, rng=0)
    before = {name: p.copy() for name, p in layer.params.items()}
    x = rng.normal(size=(2, 4, 3))
    x_before = x.copy()
    for mode in ("elementwise", "direction"):
        assert check_layer(layer, x, mode=mode, forward_kwargs={"is_causal": True}).ok
        for name, p in layer.params.items():
            np.testing.assert_array_equal(p, before[name])  # restored bit for bit
    np.testing.assert_array_equal(x, x_before)


def test_check_layer_certifies_a_float32_layer_in_float64_by_default(rng):
    layer = SelfAttention(3, 2, qkv_bias=True, rng=0, dtype=np.float32)
    report = check_layer(layer, rng.normal(size=(4, 3)))
    assert report.dtype == FLOAT64 and report.rtol <= 1e-6
    assert report.ok, report.table()
    assert all(p.dtype == np.float32 for p in layer.params.values())  # layer untouched


def test_check_layer_in_float32_uses_a_cast_copy(rng):
    layer = MultiHeadAttention(4, 2, rng=0)
    before = {name: p.copy() for name, p in layer.params.items()}
    report = check_layer(layer, rng.normal(size=(1, 3, 4)), dtype=np.float32)
    assert report.dtype == FLOAT32 and report.rtol == TOLERANCES[FLOAT32]["central"].rtol
    assert report.ok, report.table()
    assert all(p.dtype == np.float64 for p in layer.params.values())  # original untouched
    for name, p in layer.params.items():
        np.testing.assert_array_equal(p, before[name])


def test_same_seed_same_report(attention_inputs):
    a = check_op(F.attention_forward, F.attention_backward, attention_inputs, rng=5)
    b = check_op(F.attention_forward, F.attention_backward, attention_inputs, rng=5)
    assert a.rows == b.rows


def test_direction_mode_costs_two_forwards_per_direction(rng):
    calls = []

    def fun(x, W):
        calls.append(1)
        return F.linear_forward(x, W)[0]

    def vjp(dout, x, W):
        dx, dW, _ = F.linear_backward(dout, F.linear_forward(x, W)[1])
        return {"x": dx, "W": dW}

    inputs = {"x": rng.normal(size=(50, 40)), "W": rng.normal(size=(40, 30))}  # 3200 entries
    report = check_function(fun, inputs, vjp, mode="direction", num_directions=3)
    assert report.ok, report.table()
    assert len(calls) == 1 + 2 * 3 * 2  # one unperturbed forward, then 2 per direction per tensor


# ---------------------------------------------------------------- wrong gradients fail


@pytest.mark.parametrize("mode", ["elementwise", "direction"])
def test_softmax_backward_without_row_sum_term_fails(mode, rng):
    scores = rng.normal(size=(3, 4))
    good = check_op(F.softmax_forward, F.softmax_backward, {"scores": scores}, mode=mode)
    bad = check_op(F.softmax_forward, bad_softmax_backward, {"scores": scores}, mode=mode)
    assert good.ok, good.table()
    assert not bad.ok and not bad.row("scores").ok
    assert bad.row("scores").max_rel_err > 1e-2


@pytest.mark.parametrize("mode", ["elementwise", "direction"])
def test_transposed_weight_gradient_fails_on_the_weight_row_only(mode, rng):
    inputs = {"x": rng.normal(size=(5, 3)), "W": rng.normal(size=(3, 3)), "b": rng.normal(size=3)}
    report = check_op(F.linear_forward, transposed_linear_backward, inputs, mode=mode)
    assert not report.ok
    assert not report.row("W").ok
    assert report.row("x").ok and report.row("b").ok


@pytest.mark.parametrize("mode", ["elementwise", "direction"])
def test_gradient_off_by_a_factor_fails(mode, attention_inputs):
    report = check_op(F.attention_forward, unscaled_attention_backward, attention_inputs,
                      mode=mode)
    assert not report.ok
    assert not report.row("query").ok
    assert report.row("key").ok and report.row("value").ok
    if mode == "elementwise":
        row = report.row("query")
        # the analytic value is the numeric one divided by scale = 1/sqrt(4) = 0.5
        assert row.analytic == pytest.approx(2 * row.numeric, rel=1e-6)


def test_one_wrong_entry_is_found_at_its_index():
    x = np.arange(1.0, 13.0).reshape(3, 4) / 7

    def vjp(dout, x):
        grad = 2 * x * dout
        grad[1, 2] += 1e-4  # a small error in one entry only
        return {"x": grad}

    report = check_function(square, {"x": x}, vjp)
    row = report.row("x")
    assert not report.ok and not row.ok
    assert row.worst_index == (1, 2)
    assert row.analytic - row.numeric == pytest.approx(1e-4, rel=1e-4)
    assert row.max_abs_err == pytest.approx(1e-4, rel=1e-4)
    assert check_function(square, {"x": x}, vjp, mode="direction").ok is False


def test_float32_check_catches_a_wrong_factor():
    x = np.linspace(-1, 1, 6)
    assert check_function(square, {"x": x}, square_vjp, dtype=np.float32).ok
    wrong = check_function(square, {"x": x}, lambda dout, x: {"x": 2.5 * x * dout},
                           dtype=np.float32)
    assert not wrong.ok


def test_broken_layer_backward_fails(monkeypatch, rng):
    original = MultiHeadAttention.backward

    def backward(self, dout):
        result = original(self, dout)
        self.grads["W_value"] *= 1.001  # 0.1 % off
        return result

    monkeypatch.setattr(MultiHeadAttention, "backward", backward)
    report = check_layer(MultiHeadAttention(4, 2, rng=0), rng.normal(size=(2, 3, 4)))
    assert [row.name for row in report.rows if not row.ok] == ["param W_value"]


def test_nan_gradient_fails_with_infinite_error():
    report = check_function(square, {"x": np.ones(3)},
                            lambda dout, x: {"x": np.full(3, np.nan)})
    assert not report.ok and report.row("x").max_rel_err == np.inf


# ---------------------------------------------------------------- report and table


def test_table_shows_names_values_index_and_verdicts():
    x = np.arange(1.0, 7.0).reshape(2, 3)

    def vjp(dout, x, y):
        return {"x": 2 * x * dout, "y": 3 * dout}  # y's true gradient is 2 * dout

    report = check_function(lambda x, y: x ** 2 + 2 * y, {"x": x, "y": x.copy()}, vjp)
    table = report.table()
    assert str(report) == table
    lines = table.splitlines()
    # the method and its truncation order, then the settings
    assert lines[0].startswith("gradcheck (central O(h^2), elementwise, float64, eps=1e-05, "
                               "rtol=1e-06")
    assert lines[0].endswith("FAILED")
    # the failing row's diagnosis, in words, under the table: a constant ratio
    # 3/2, which is not among the documented forms (integers, roots, reciprocals)
    assert lines[-2] == "diagnosis:"
    assert lines[-1].startswith("  y: constant ratio analytic / numeric = 1.5 (no simple form)")
    for column in ("tensor", "shape", "max abs err", "max rel err", "worst index",
                   "analytic", "numeric"):
        assert column in lines[1]
    x_line = next(line for line in lines if line.startswith("x "))
    y_line = next(line for line in lines if line.startswith("y ") and "(2, 3)" in line)
    assert x_line.endswith("ok") and y_line.endswith("FAIL")
    row = report.row("y")
    assert str(row.worst_index) in y_line and "(2, 3)" in y_line
    assert f"{row.analytic:+.9e}" in y_line and f"{row.numeric:+.9e}" in y_line
    assert "ok=False" in repr(report)


def test_raise_if_failed_raises_a_value_error_with_the_table():
    good = check_function(square, {"x": np.ones(2)}, square_vjp)
    assert good.raise_if_failed() is good
    bad = check_function(square, {"x": np.ones(2)}, lambda dout, x: {"x": dout})
    with pytest.raises(GradcheckError) as info:
        bad.raise_if_failed()
    assert isinstance(info.value, ValueError) and not isinstance(info.value, AssertionError)
    assert bad.table() in str(info.value)


def test_direction_table_names_the_direction():
    report = check_function(square, {"x": np.ones(5)}, lambda dout, x: {"x": dout},
                            mode="direction", num_directions=4)
    row = report.row("x")
    assert isinstance(row.worst_index, int) and 0 <= row.worst_index < 4
    assert f"u{row.worst_index}" in report.table()


def test_row_lookup_names_the_rows():
    report = check_function(square, {"x": np.ones(2)}, square_vjp)
    with pytest.raises(KeyError, match="rows are \\['x'\\]"):
        report.row("W")


def test_skipped_inputs_and_pass_through_arguments(rng):
    # None (or a missing name) means "not differentiable": no row, no error.
    mask = np.tril(np.ones((3, 5), dtype=bool))
    inputs = {"query": rng.normal(size=(3, 2)), "key": rng.normal(size=(5, 2)),
              "value": rng.normal(size=(5, 4)), "attn_mask": mask}

    def fun(query, key, value, attn_mask):
        return F.attention_forward(query, key, value, attn_mask)[0]

    def vjp(dout, query, key, value, attn_mask):
        dquery, dkey, dvalue = F.attention_backward(
            dout, F.attention_forward(query, key, value, attn_mask)[1])
        return {"query": dquery, "value": dvalue, "attn_mask": None}

    report = check_function(fun, inputs, vjp)
    assert [row.name for row in report.rows] == ["query", "value"] and report.ok
    wrt = check_op(F.attention_forward, F.attention_backward,
                   {k: inputs[k] for k in ("query", "key", "value")}, wrt=["key"])
    assert [row.name for row in wrt.rows] == ["key"] and wrt.ok


# ---------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("options, error, message", [
    ({"mode": "fast"}, ValueError, "mode must be one of"),
    ({"dtype": np.float16}, ValueError, "dtype must be one of .*got float16"),
    ({"dtype": "nonsense"}, TypeError, "dtype must be float32 or float64"),
    ({"eps": 0.0}, ValueError, "eps must be a finite positive number, got 0.0"),
    ({"eps": -1e-3}, ValueError, "eps must be a finite positive"),
    ({"eps": "1e-3"}, TypeError, "eps must be a real number, got str"),
    ({"rtol": np.nan}, ValueError, "rtol must be a finite non-negative"),
    ({"atol": [1e-3]}, TypeError, "atol must be a real number, got list"),
    ({"num_directions": 0}, ValueError, r"num_directions must be an int in 1\.\.10000 "
                                        r"\(MAX_DIRECTIONS\), got 0"),
    # one above the bound; was accepted, so that 10**9 ran for days
    ({"mode": "direction", "num_directions": 10_001}, ValueError,
     r"num_directions must be an int in 1\.\.10000 \(MAX_DIRECTIONS\), got 10001"),
    ({"num_directions": 2.0}, TypeError, "num_directions must be an int, got float"),
    ({"rng": "seed"}, TypeError, "rng must be"),
])
def test_bad_options(options, error, message):
    with pytest.raises(error, match=message):
        check_function(square, {"x": np.ones(2)}, square_vjp, **options)


def test_bad_inputs_and_gradients():
    with pytest.raises(TypeError, match="inputs must be a dict name -> array, got list"):
        check_function(square, [np.ones(2)], square_vjp)
    with pytest.raises(ValueError, match=r"gradient of 'x' must have the shape of 'x', "
                                         r"\(2,\), got shape \(3,\)"):
        check_function(square, {"x": np.ones(2)}, lambda dout, x: {"x": np.ones(3)})
    with pytest.raises(ValueError, match=r"unknown inputs \['y'\]"):
        check_function(square, {"x": np.ones(2)}, lambda dout, x: {"y": dout})
    with pytest.raises(TypeError, match="vjp must return a dict"):
        check_function(square, {"x": np.ones(2)}, lambda dout, x: 2 * x * dout)
    with pytest.raises(ValueError, match="no gradient: nothing to check"):
        check_function(square, {"x": np.ones(2)}, lambda dout, x: {"x": None})
    with pytest.raises(ValueError, match="'x' contains NaN or inf"):
        check_function(lambda x: np.tanh(x), {"x": np.array([1.0, np.inf])},
                       lambda dout, x: {"x": dout / np.cosh(x) ** 2})
    with pytest.raises(ValueError, match="returned NaN or inf at the unperturbed input"):
        check_function(square, {"x": np.array([1.0, np.inf])}, square_vjp)
    with pytest.raises(TypeError, match="not a float array .*got str"):
        check_function(lambda x, s: x, {"x": np.ones(2), "s": "a"},
                       lambda dout, x, s: {"x": dout, "s": dout})
    with pytest.raises(TypeError, match="must return a float array, got dtype bool"):
        check_function(lambda x: x > 0, {"x": np.ones(2)}, square_vjp)


def test_bad_op_and_layer_arguments(rng):
    inputs = {"x": rng.normal(size=(2, 3)), "W": rng.normal(size=(3, 2))}
    with pytest.raises(ValueError, match=r"wrt names \['b'\] are not inputs"):
        check_op(F.linear_forward, F.linear_backward, inputs, wrt=["b"])
    with pytest.raises(ValueError, match="one gradient per input .* got 1 values"):
        check_op(F.linear_forward, lambda dout, cache: (dout,), inputs)
    with pytest.raises(ValueError, match="extra entries must be None"):
        check_op(F.linear_forward, lambda dout, cache: F.linear_backward(dout, cache)[:2] + (dout,),
                 inputs)
    layer = SelfAttention(3, 2, rng=0)
    with pytest.raises(ValueError, match="at least one input array"):
        check_layer(layer)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        check_layer(layer, rng.normal(size=(2, 3)), bogus=1)
    with pytest.raises(ValueError, match="must not set return_weights"):
        check_layer(layer, rng.normal(size=(2, 3)), forward_kwargs={"return_weights": True})
    with pytest.raises(TypeError, match="layer must have params"):
        check_layer(object(), rng.normal(size=(2, 3)))


def test_import_pulls_in_numpy_only():
    code = ("import sys, qkvnp.gradcheck; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'scipy', 'torch', 'matplotlib', 'hypothesis', 'pytest'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------- command line


@pytest.fixture
def cli(monkeypatch, capsys):
    """Run ``qkvnp.apps.cli.main(["gradcheck", ...])``; return (exit code, stdout + stderr).

    Only the gradcheck command is registered, so that this test does not
    depend on the other commands' modules. Errors go to stderr, as argparse's do.
    """
    monkeypatch.setattr(qkvnp.apps.cli, "COMMANDS", {"gradcheck": qkvnp.apps.cli.COMMANDS["gradcheck"]})

    def run(*argv):
        code = qkvnp.apps.cli.main(["gradcheck", *argv])
        captured = capsys.readouterr()
        return code, captured.out + captured.err

    return run


@pytest.mark.parametrize("argv", [
    [],  # defaults: both layers, self-attention, float64, elementwise
    ["--mask", "bool", "--causal", "--kv-seq", "3"],  # cross-attention, fully masked row
    ["--mask", "float", "--no-bias", "--mode", "direction"],
    ["--mask", "padding", "--dtype", "float32", "--batch", "2", "--seq", "3"],
    # grouped-query (one key/value head for two), bottom-right causal, T > S: dead rows
    ["--kv-heads", "1", "--causal", "bottom_right", "--kv-seq", "3"],
])
def test_cli_passes_on_the_layers(cli, argv):
    code, out = cli(*argv)
    assert code == 0, out
    assert "SelfAttention" in out and "MultiHeadAttention" in out
    assert "all gradients OK" in out and "FAIL" not in out
    assert "param W_out" in out and "param W_query" in out and "input 0" in out
    if "--kv-seq" in argv:
        assert "input 2" in out and "cross-attention T=4, S=3" in out
    if "--kv-heads" in argv:
        assert "num_kv_heads=1)" in out
    if "--no-bias" in argv:
        assert "b_key" not in out
    else:
        assert "param b_key" in out


def test_cli_fails_on_a_broken_backward(cli, monkeypatch):
    original = SelfAttention.backward

    def backward(self, dout):
        result = original(self, dout)
        self.grads["W_key"] = self.grads["W_key"].T.reshape(self.grads["W_key"].shape)
        return result

    monkeypatch.setattr(SelfAttention, "backward", backward)
    code, out = cli()
    assert code == 1
    assert "GRADIENT CHECK FAILED" in out
    failed = [line for line in out.splitlines() if line.rstrip().endswith("FAIL")]
    assert [line.split()[:2] for line in failed] == [["param", "W_key"]]


def test_cli_reports_bad_sizes(cli):
    code, out = cli("--embed", "6", "--heads", "4")
    assert code == 2 and "--heads must divide --embed" in out


@pytest.mark.parametrize("argv, message", [
    (["--eps", "0"], "--eps must be a finite positive number, got 0.0"),  # was a traceback
    (["--eps=-1e-6"], "--eps must be a finite positive number, got -1e-06"),
    (["--eps", "nan"], "--eps must be a finite positive number, got nan"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),  # was numpy's "expected non-negative"
    (["--batch", "0"], "--batch must be a positive int <= 4096, got 0"),
    (["--kv-seq", "0"], "--kv-seq must be a positive int <= 4096, got 0"),
    (["--heads", "2", "--kv-heads", "3"], "--kv-heads must divide --heads, got heads=2 and kv-heads=3"),
    (["--embed", "100000"], "--embed must be a positive int <= 4096"),  # was a MemoryError
    (["--embed", "1024", "--heads", "2"], "sizes too large for a numerical check"),
    (["--sweep-eps", "--eps", "1e-3"], "--eps does not apply to --sweep-eps"),
    (["--sweep-eps", "--mode", "direction", "--dtype", "float32"],
     "--mode, --dtype do not apply to --sweep-eps"),
    # the next four were ignored silently: these studies take no step, mode or method
    (["--second-order", "--method", "central4"], "--method does not apply to --second-order"),
    (["--second-order", "--eps", "1e-3", "--mode", "direction"],
     "--eps, --mode do not apply to --second-order"),
    (["--oracle", "--eps", "1e-3"], "--eps does not apply to --oracle"),
    (["--oracle", "--method", "central", "--mode", "elementwise"],
     "--mode, --method do not apply to --oracle"),
])
def test_cli_refuses_bad_options_under_its_usage_before_any_work(monkeypatch, capsys, argv,
                                                                 message):
    # oracle: argparse's format: the gradcheck usage, then "<prog> gradcheck: error: ..."
    import qkvnp.gradcheck.command as command

    monkeypatch.setattr(command, "check_layer", lambda *a, **k: pytest.fail("work started"))
    monkeypatch.setattr(command, "sweep_steps", lambda *a, **k: pytest.fail("work started"))
    assert qkvnp.apps.cli.main(["gradcheck", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and "Traceback" not in captured.err
    assert lines[0].startswith("usage: ") and " gradcheck [-h] " in lines[0]
    assert " gradcheck: error: " in lines[-1] and message in lines[-1], lines[-1]


def test_cli_sweep_eps_plot_without_matplotlib_is_refused_before_the_sweep(monkeypatch, capsys,
                                                                          tmp_path):
    # was: said so, swept, and exited 0 with no plot
    import qkvnp.gradcheck.command as command

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setattr(command, "sweep_steps", lambda *a, **k: pytest.fail("work started"))
    assert qkvnp.apps.cli.main(["gradcheck", "--sweep-eps", "--plot", str(tmp_path / "s.png")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert lines[0].startswith("usage: ") and " gradcheck: error: --plot " in lines[-1]
    assert "matplotlib is not installed" in lines[-1] and "pip install 'qkvnp[plot]'" in lines[-1]
    assert not list(tmp_path.iterdir())


def test_cli_sweep_eps_shows_truncation_and_round_off(cli, tmp_path):
    # small layers (the sweep costs 19 steps x 3 methods x 2 dtypes per entry)
    curves, picture = tmp_path / "curves.json", tmp_path / "sweep.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # an optional extra: --plot is refused without it
        plot = []
    else:
        plot = ["--plot", str(picture)]
    code, out = cli("--sweep-eps", "--batch", "1", "--seq", "3", "--embed", "4", "--d-out", "3",
                    "--json", str(curves), *plot)
    assert code == 0, out
    rows = re.findall(r"^\s*(\de-\d\d)\s+(\S+)\s+(\S+)$", out, flags=re.M)
    eps = np.array([float(e) for e, _, _ in rows])
    # half a decade apart, as printed with one digit: 1e-01, 3e-02, 1e-02, ..., 1e-10
    assert list(eps) == [float(f"{10.0 ** (-k / 2):.0e}") for k in range(2, 21)]
    err64 = np.array([float(e) for _, e, _ in rows])
    err32 = np.array([float(e) for _, _, e in rows])
    best64 = float(re.search(r"best eps for float64: (\S+)", out).group(1))
    best32 = float(re.search(r"best eps for float32: (\S+)", out).group(1))
    # Optimal central-difference step ~ (3 eps_mach)^(1/3) times the function's
    # scale: ~9e-6 in float64, ~7e-3 in float32 (measured: 1e-5, and 1e-2).
    assert 1e-6 <= best64 <= 1e-4
    assert 1e-3 <= best32 <= 3e-2
    assert err64.min() < 1e-6 and err32.min() < 5e-2
    # V shape: truncation error at large eps, round-off at small eps
    assert err64[0] > 1e3 * err64.min() and err64[-1] > 1e3 * err64.min()
    assert err64[0] > err64[2] > err64[4]  # truncation falls as eps^2
    assert err32[10] > 10 * err32.min()  # eps = 1e-6 in float32: round-off dominates
    # the fitted slopes: 2 and -1 for central, 4 for central4, per layer
    fits = re.findall(r"^(central4?|complex_step)\s+(float\d\d)\s+(\S+)\s+(\S+)\s", out,
                      flags=re.M)
    slopes = {(m, d): (t, r) for m, d, t, r in fits}
    assert float(slopes["central", "float64"][0]) == pytest.approx(2, abs=0.3)
    assert float(slopes["central", "float64"][1]) == pytest.approx(-1, abs=0.3)
    assert float(slopes["central4", "float64"][0]) == pytest.approx(4, abs=0.6)
    # the curves as JSON: every tensor of both layers, per method and dtype
    result = json.loads(curves.read_text())
    assert {(c["method"], c["dtype"]) for c in result["curves"]} == {
        ("central", "float64"), ("central", "float32"), ("central4", "float64"),
        ("central4", "float32"), ("complex_step", "float64")}
    assert {c["tensor"] for c in result["curves"]} >= {"param W_query", "param W_out", "input 0"}
    if plot:  # the picture
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_gallery_catches_every_broken_backward(cli):
    code, out = cli("--gallery")
    assert code == 0, out
    assert "every broken backward caught and diagnosed, every correct one passed" in out
    assert "~ 1/sqrt(2)" in out and "diagnosis transposed (expected transposed)" in out


@pytest.mark.parametrize("argv, expected", [
    (["--method", "complex_step", "--mask", "bool", "--causal", "--kv-seq", "3", "--impl", "fast"],
     "complex_step O(h^2), no cancellation, elementwise, float64, eps=1e-30"),
    (["--method", "central4", "--mask", "float"], "central4 O(h^4)"),
    (["--method", "richardson", "--mode", "direction"], "richardson O(h^2k), Ridders, direction"),
    (["--oracle", "--impl", "tiled", "--mask", "padding"], "oracle float64, float32 backward"),
    (["--second-order", "--mask", "bool", "--causal"], "relative asymmetry"),
])
def test_cli_methods_and_studies_pass_on_the_layers(cli, argv, expected):
    code, out = cli(*argv)
    assert code == 0, out
    assert expected in out
    assert "FAILED" not in out


@pytest.mark.parametrize("argv, message", [
    (["--gallery", "--sweep-eps"], "--sweep-eps and --gallery are separate studies"),
    (["--gallery", "--method", "central4"], "--method does not apply to --gallery"),
    (["--json", "out.json"], "--json applies to --sweep-eps only"),
    (["--method", "complex_step", "--dtype", "float32"], "complex_step runs in float64 only"),
])
def test_cli_refuses_bad_study_combinations(capsys, monkeypatch, argv, message):
    import qkvnp.gradcheck.command as command

    monkeypatch.setattr(command, "check_layer", lambda *a, **k: pytest.fail("work started"))
    assert qkvnp.apps.cli.main(["gradcheck", *argv]) == 2
    assert message in capsys.readouterr().err
