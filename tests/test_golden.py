"""qkvnp against PyTorch-generated golden values, without PyTorch.

Oracle: ``tests/golden/*.npz``, written by ``tests/make_golden.py`` from
PyTorch 2.13 in float64 (``scaled_dot_product_attention`` and
``nn.MultiheadAttention(batch_first=True)``, weights mapped to qkvnp's layout).
Each file holds the inputs, masks, weights, upstream gradient ``dout``, the
output, the attention weights and every gradient; fully masked rows are 0 in
the stored weights (torch's NaN replaced, as qkvnp defines them). Outputs and
gradients must agree to 1e-10 (``max|ours - golden| / max(1, max|golden|)``).
The files are read with ``allow_pickle=False``.
"""
from pathlib import Path

import numpy as np
import pytest

import qkvnp
from qkvnp import functional as F

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
TOL = 1e-10
SDPA_FILES = sorted(GOLDEN_DIR.glob("sdpa_*.npz"))
MHA_FILES = sorted(GOLDEN_DIR.glob("mha_*.npz"))


def load(path):
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def assert_golden(what, ours, golden):
    assert ours.shape == golden.shape, f"{what}: shape {ours.shape}, golden {golden.shape}"
    assert ours.dtype == np.float64
    err = np.abs(ours - golden).max() / max(1.0, np.abs(golden).max())
    worst = np.unravel_index(np.argmax(np.abs(ours - golden)), ours.shape)
    assert err <= TOL, (f"{what}: scaled error {err:.3e} > {TOL}; at {worst} ours "
                        f"{ours[worst]!r}, golden {golden[worst]!r}")


def test_golden_files_are_present_and_small():
    """The data files exist (a missing file must not silently skip the check)."""
    names = {p.stem for p in SDPA_FILES + MHA_FILES}
    assert {"sdpa_plain", "sdpa_bool_mask", "sdpa_float_mask_causal", "sdpa_causal_unbatched",
            "mha_self_causal", "mha_cross_padding", "mha_cross_float_mask"} <= names
    assert sum(p.stat().st_size for p in SDPA_FILES + MHA_FILES) < 300_000
    # the reference grid (tests/reference_grid.py) is the other file here
    assert (GOLDEN_DIR / "reference_grid.npz").stat().st_size < 600_000


@pytest.mark.parametrize("path", SDPA_FILES, ids=lambda p: p.stem)
def test_sdpa_matches_golden(path):
    """attention_forward/backward reproduce torch's output, weights and gradients."""
    g = load(path)
    scale = float(g["scale"]) if "scale" in g else None
    out, cache = F.attention_forward(g["query"], g["key"], g["value"], g.get("attn_mask"),
                                     bool(g["is_causal"]), scale)
    dquery, dkey, dvalue = F.attention_backward(g["dout"], cache)
    assert_golden("out", out, g["out"])
    assert_golden("weights", cache.weights, g["weights"])
    assert_golden("dquery", dquery, g["dquery"])
    assert_golden("dkey", dkey, g["dkey"])
    assert_golden("dvalue", dvalue, g["dvalue"])


@pytest.mark.parametrize("path", MHA_FILES, ids=lambda p: p.stem)
def test_multihead_matches_golden(path, impl):
    """MultiHeadAttention reproduces torch's output, per-head weights and every gradient."""
    g = load(path)
    params = {name[len("param_"):]: a for name, a in g.items() if name.startswith("param_")}
    E = params["W_query"].shape[0]
    layer = qkvnp.MultiHeadAttention(
        E, int(g["num_heads"]), bias="b_query" in params, kdim=params["W_key"].shape[0],
        vdim=params["W_value"].shape[0], rng=0, impl=impl)
    assert set(layer.params) == set(params)
    for name, value in params.items():
        layer.params[name][...] = value
    cross = "key" in g
    out, weights = layer.forward(g["query"], g.get("key"), g.get("value"),
                                 attn_mask=g.get("attn_mask"), is_causal=bool(g["is_causal"]),
                                 key_padding_mask=g.get("key_padding_mask"),
                                 return_weights=True)
    input_grads = layer.backward(g["dout"])
    assert_golden("out", out, g["out"])
    assert_golden("weights", weights, g["weights"])
    if cross:
        for name, grad in zip(("dquery", "dkey", "dvalue"), input_grads):
            assert_golden(name, grad, g[name])
    else:
        assert_golden("dx", input_grads, g["dx"])
    for name in params:
        assert_golden(f"d{name}", layer.grads[name], g[f"grad_{name}"])
