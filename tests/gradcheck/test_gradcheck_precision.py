"""Mixed-precision oracles, second-order symmetry and the step sweep (issue 12).

Oracles: the float64 analytic gradient on the reference path (for the
float32 backwards of the fast and tiled paths, normwise in float32
epsilons); the symmetry of a Hessian (``<v, Hu> = <u, Hv>`` for any
gradient of a scalar function); closed forms of the error of a difference
quotient (slopes 2, 4 and -1 on log-log axes).
"""
import json

import numpy as np
import pytest

from qkvnp import MultiHeadAttention, SelfAttention, kernels
from qkvnp.layers import Embedding, Linear
from qkvnp import functional as F
from qkvnp.gradcheck import (ORACLE_EPS, check_layer, check_op, check_symmetry_function,
                             check_symmetry_layer, check_symmetry_op, sweep_steps)
from qkvnp.gradcheck.sweep import OPTIMAL_STEPS, fit_branches

EPS32 = float(np.finfo(np.float32).eps)


def layer_cases(rng):
    x = rng.normal(size=(2, 5, 8))
    memory = rng.normal(size=(2, 3, 8)), rng.normal(size=(2, 3, 8))
    keep = rng.random((2, 1, 5, 5)) < 0.7
    keep[..., 0] = True
    keep[0, 0, -1] = False  # a fully masked row
    padding = np.array([[True, True, False], [False, False, False]])  # one padded sequence
    return [
        (lambda impl: SelfAttention(8, 6, qkv_bias=True, rng=2, dtype=np.float32, impl=impl),
         (x,), {"is_causal": True}),
        (lambda impl: MultiHeadAttention(8, 2, rng=2, dtype=np.float32, impl=impl), (x,),
         {"attn_mask": keep}),
        (lambda impl: MultiHeadAttention(8, 4, rng=2, dtype=np.float32, impl=impl),
         (x, *memory), {"key_padding_mask": padding}),
    ]


def randomize_biases(layer, rng):
    for name, param in layer.params.items():
        if name.startswith("b_"):
            param[...] = rng.normal(scale=0.5, size=param.shape)
    return layer


# Worst normwise error measured at these shapes, in float32 epsilons (the
# number the issue asks for): with this test's seed fast 8.3, tiled 4.1,
# reference 5.5; over seeds 0..19 the worst was 26 (tiled), 21 (reference)
# and 11 (fast), each on the key input of the cross-attention case, medians
# 2.9 / 3.7 / 2.8. All within the 64-epsilon default.
@pytest.mark.parametrize("impl", ["fast", "tiled", "reference"])
def test_float32_backwards_within_64_eps_of_the_float64_reference(impl, rng):
    worst = 0.0
    with kernels.block_sizes(tiled_block=(2, 2)):  # several blocks even at T = 5
        for make, inputs, kwargs in layer_cases(rng):
            layer = randomize_biases(make(impl), rng)
            report = check_layer(layer, *inputs, forward_kwargs=kwargs, dtype=np.float32,
                                 oracle_dtype=np.float64)
            assert report.ok, report.table()
            assert report.method == "oracle float64"
            assert report.rtol == pytest.approx(ORACLE_EPS * EPS32)
            assert report.dispatch.path == impl  # the path under test really ran (in the copy)
            worst = max(worst, report.max_rel_err / EPS32)
    assert 0 < worst <= ORACLE_EPS  # the float32 round-off was seen, and is within the mark


def test_the_oracle_catches_a_float32_error_that_central_differences_cannot(rng, monkeypatch):
    # Oracle: the float32 backward times (1 + 1e-4): 800 epsilons, yet below
    # the float32 central-difference tolerance of 5e-2.
    inputs = {"query": rng.normal(size=(2, 3, 4)), "key": rng.normal(size=(2, 5, 4)),
              "value": rng.normal(size=(2, 5, 3))}

    def off(dout, cache):
        return tuple(g * np.float32(1 + 1e-4) if g.dtype == np.float32 else g
                     for g in F.attention_backward(dout, cache))

    assert check_op(F.attention_forward, off, inputs, dtype=np.float32).ok
    report = check_op(F.attention_forward, off, inputs, dtype=np.float32, oracle_dtype=np.float64)
    assert not report.ok
    assert all(700 < row.max_rel_err / EPS32 < 900 for row in report.rows), report.table()
    right = check_op(F.attention_forward, F.attention_backward, inputs, dtype=np.float32,
                     oracle_dtype=np.float64)
    assert right.ok, right.table()
    assert "err / eps" in right.table() and "oracle" in right.table()


def test_oracle_options_are_checked(rng):
    inputs = {"x": rng.normal(size=(3, 4)), "W": rng.normal(size=(4, 2))}
    with pytest.raises(TypeError, match="takes only"):
        check_op(F.linear_forward, F.linear_backward, inputs, oracle_dtype=np.float64,
                 method="central4")
    with pytest.raises(ValueError, match="at least as precise"):
        check_op(F.linear_forward, F.linear_backward, inputs, dtype=np.float64,
                 oracle_dtype=np.float32)


# ---------------------------------------------------------------- second order


OPS = [
    ("linear", F.linear_forward, F.linear_backward,
     {"x": (2, 3, 4), "W": (4, 5), "b": (5,)}, {}),
    ("softmax", F.softmax_forward, F.softmax_backward, {"scores": (2, 3, 4)}, {}),
    ("attention, causal", F.attention_forward, F.attention_backward,
     {"query": (2, 3, 4), "key": (2, 5, 4), "value": (2, 5, 3)}, {"is_causal": True}),
    ("split heads", F.split_heads_forward, F.split_heads_backward, {"x": (2, 3, 6)},
     {"num_heads": 3}),
    ("merge heads", F.merge_heads_forward, F.merge_heads_backward, {"x": (2, 3, 4, 2)}, {}),
    ("embedding", F.embedding_forward, F.embedding_backward, {"weight": (5, 3)},
     {"indices": np.array([[0, 4, 4], [2, 0, 1]])}),
]


@pytest.mark.parametrize("name, forward, backward, shapes, kwargs", OPS, ids=[o[0] for o in OPS])
def test_hessian_vector_products_are_symmetric_for_every_op(name, forward, backward, shapes,
                                                             kwargs, rng):
    inputs = {key: rng.normal(size=shape) for key, shape in shapes.items()}
    report = check_symmetry_op(forward, backward, inputs, forward_kwargs=kwargs)
    assert report.ok and report.relative <= 1e-6, report
    if name in ("split heads", "merge heads", "embedding"):  # linear: a zero Hessian
        assert report.hvp_max == 0.0


def test_hessian_vector_products_are_symmetric_for_both_layers(rng, impl):
    x = rng.normal(size=(2, 4, 6))
    keep = rng.random((2, 4, 4)) < 0.7
    keep[..., 0] = True
    keep[1, 2] = False
    for layer, kwargs in ((SelfAttention(6, 4, qkv_bias=True, rng=3, impl=impl),
                           {"attn_mask": keep}),
                          (MultiHeadAttention(6, 2, rng=3, impl=impl), {"is_causal": True})):
        report = check_symmetry_layer(randomize_biases(layer, rng), x, forward_kwargs=kwargs)
        assert report.ok and report.relative <= 1e-6, report
        assert abs(report.v_hu) > 1e-3  # a real curvature was measured, not two zeros
    # the small layers: a bilinear x @ W (a symmetric off-diagonal Hessian) and a lookup
    assert check_symmetry_layer(Linear(6, 3, rng=0), x).ok
    assert check_symmetry_layer(Embedding(5, 3, rng=0), np.array([[0, 4, 4]])).ok


def test_a_backward_that_is_no_gradient_fails_the_symmetry_check(rng):
    # Oracle: g(q) = true gradient + 1e-4 * roll(query) is the gradient of no
    # scalar function (its Jacobian, a cyclic shift, is not symmetric); the
    # loose float32 first-order check misses it, the symmetry check does not.
    inputs = {"query": rng.normal(size=(2, 3, 4)), "key": rng.normal(size=(2, 5, 4)),
              "value": rng.normal(size=(2, 5, 3))}

    def planted(dout, cache):
        dquery, dkey, dvalue = F.attention_backward(dout, cache)
        return dquery + 1e-4 * np.roll(cache.query, 1, axis=-1), dkey, dvalue

    assert check_op(F.attention_forward, planted, inputs, dtype=np.float32).ok
    report = check_symmetry_op(F.attention_forward, planted, inputs)
    assert not report.ok and report.relative > 1e-5, report
    assert check_symmetry_op(F.attention_forward, F.attention_backward, inputs).ok


def test_symmetry_of_a_known_hessian():
    # Oracle: L = <dout, x^3> has the diagonal Hessian 6 x dout: symmetric.
    report = check_symmetry_function(lambda x: x ** 3, {"x": np.arange(1.0, 5.0)},
                                     lambda dout, x: {"x": 3 * x ** 2 * dout})
    assert report.ok and report.asymmetry < 1e-9


# ---------------------------------------------------------------- the sweep


def test_fit_branches_recovers_known_slopes():
    h = np.logspace(-1, -10, 10)
    fit = fit_branches(h, 3 * h ** 4 + 1e-16 / h)
    assert fit["truncation_slope"] == pytest.approx(4, abs=0.05)
    assert fit["roundoff_slope"] == pytest.approx(-1, abs=0.05)
    assert fit["best_eps"] == pytest.approx(1e-4)  # 3e-16 + 1e-12, vs 3e-12 + 1e-13 at 1e-3
    assert fit_branches(h, np.full(10, np.inf))["best_eps"] is None


def test_sweep_fits_the_textbook_slopes_on_a_layer(tmp_path):
    layer = MultiHeadAttention(4, 2, rng=0)
    x = np.random.default_rng(0).normal(size=(1, 3, 4))
    result = sweep_steps([("mha", layer, (x,), {})])
    fits = {(e["method"], e["dtype"]): e for e in result["summary"]}
    assert set(fits) == {("central", "float64"), ("central", "float32"),
                         ("central4", "float64"), ("central4", "float32"),
                         ("complex_step", "float64")}
    assert fits["central", "float64"]["truncation_slope"] == pytest.approx(2, abs=0.3)
    assert fits["central", "float64"]["roundoff_slope"] == pytest.approx(-1, abs=0.3)
    assert fits["central4", "float64"]["truncation_slope"] == pytest.approx(4, abs=0.6)
    assert fits["complex_step", "float64"]["best_error"] < 1e-12
    assert fits["central", "float64"]["optimal_eps"] == OPTIMAL_STEPS["central", "float64"]
    # every tensor has its curves, and the result is plain JSON
    tensors = {c["tensor"] for c in result["curves"]}
    assert "param W_query" in tensors and "input 0" in tensors
    assert json.loads(json.dumps(result)) == result
