"""RoPE frequency scaling (``rope_inverse_frequency``, ``rope_forward``'s scaled frequencies).

Shape key: B batch, H heads, T length, D head dim.

Oracles: Hugging Face transformers' own ``ROPE_INIT_FUNCTIONS`` (linear,
llama3, yarn) on a ``LlamaConfig``, to 1e-12 (transformers computes them in
float32: the test alone points the module's ``torch.float``/``torch.float32``
at float64); closed forms (linear divides by the factor; llama3 keeps the
highest frequency and divides the lowest); PyTorch autograd of transformers'
``apply_rotary_pos_emb`` formula (``x * cos + rotate_half(x) * sin``, cos and
sin times the attention factor) to 1e-10 in float64, outputs and gradients
of a random upstream gradient; the complex step of :mod:`qkvnp.gradcheck` (``check_op``).
"""
import numpy as np
import pytest

from qkvnp import functional as F
from qkvnp.gradcheck import check_op

LINEAR = [{"rope_type": "linear", "factor": 2.0}, {"type": "linear", "factor": 8}]
LLAMA3 = [
    # Llama 3.1's published values, at a context short enough to cross every band at D = 16
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},  # Llama 3.2's
    {"type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
     "original_max_position_embeddings": 256},
]
YARN = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128,
     "beta_fast": 16, "beta_slow": 2.0, "truncate": False},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
     "mscale": 1.0, "mscale_all_dim": 0.707},  # DeepSeek-style mscale ratio
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
     "attention_factor": 1.5, "beta_fast": 8.0, "beta_slow": 8.0},  # a one-point ramp
]
CASES = [(16, 10000.0, s) for s in LINEAR + LLAMA3 + YARN] + [(64, 500000.0, s) for s in LLAMA3 + YARN]


class _Float64Torch:
    """``torch`` with ``float``/``float32`` pointing at float64: what transformers' functions see."""

    def __init__(self, torch):
        self._torch = torch
        self.float = self.float32 = torch.float64

    def __getattr__(self, name):
        return getattr(self._torch, name)


@pytest.fixture
def rope_utils(torch, monkeypatch):
    """transformers' ``modeling_rope_utils`` computing in float64 (patched for this test only)."""
    module = pytest.importorskip("transformers.modeling_rope_utils")
    monkeypatch.setattr(module, "torch", _Float64Torch(torch))
    return module


def hugging_face(rope_utils, head_dim, base, scaling):
    from transformers import LlamaConfig
    config = LlamaConfig(head_dim=head_dim, hidden_size=4 * head_dim, num_attention_heads=4,
                         max_position_embeddings=8 * scaling["original_max_position_embeddings"]
                         if "original_max_position_embeddings" in scaling else 2048,
                         rope_parameters={**scaling, "rope_theta": base})
    rope_type = scaling.get("rope_type", scaling.get("type"))
    inverse_frequency, attention_factor = rope_utils.ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inverse_frequency.numpy(), float(attention_factor)


@pytest.mark.parametrize("head_dim, base, scaling", CASES)
def test_inverse_frequency_and_attention_factor_match_transformers(rope_utils, head_dim, base,
                                                                   scaling):
    expected, expected_factor = hugging_face(rope_utils, head_dim, base, dict(scaling))
    inverse_frequency, attention_factor = F.rope_inverse_frequency(head_dim, base, scaling)
    assert inverse_frequency.shape == (head_dim // 2,) and inverse_frequency.dtype == np.float64
    np.testing.assert_allclose(inverse_frequency, expected, rtol=1e-12, atol=0)
    assert abs(attention_factor - expected_factor) <= 1e-12 * expected_factor


def test_closed_forms():
    plain = 100.0 ** (-np.arange(0, 8, 2) / 8)
    for scaling in (None, {"rope_type": "default"}, {"type": "default", "rope_theta": 100.0}):
        w, factor = F.rope_inverse_frequency(8, 100.0, scaling)
        assert factor == 1.0 and np.array_equal(w, plain)
    w, _ = F.rope_inverse_frequency(8, 100.0, {"rope_type": "linear", "factor": 4.0})
    np.testing.assert_allclose(w, plain / 4, rtol=1e-15)
    # llama3: the fastest pair (wavelength 2 pi < 64 / 4) kept, the slowest (2 pi 10^4 > 64) divided
    w, _ = F.rope_inverse_frequency(16, 10000.0, LLAMA3[0])
    full = 10000.0 ** (-np.arange(0, 16, 2) / 16)
    assert w[0] == full[0] and w[-1] == full[-1] / 8
    # yarn: the attention factor 0.1 ln(4) + 1 when none is given
    assert F.rope_inverse_frequency(16, 10000.0, YARN[0])[1] == pytest.approx(0.1 * np.log(4) + 1,
                                                                               rel=1e-15)


def test_default_rope_forward_unchanged_by_the_default_frequencies():
    # the default inverse frequencies and factor 1 give exactly today's rope_forward
    x = np.random.default_rng(0).standard_normal((2, 5, 8))
    w, factor = F.rope_inverse_frequency(8, 500.0)
    plain, _ = F.rope_forward(x, base=500.0)
    scaled, _ = F.rope_forward(x, inverse_frequency=w, attention_factor=factor)
    assert np.array_equal(plain, scaled)


def rotate_half(torch, x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("scaling", [LINEAR[0], LLAMA3[0], YARN[0], YARN[2]],
                         ids=["linear", "llama3", "yarn", "yarn-mscale"])
def test_scaled_rope_matches_torch_autograd(torch, scaling):
    rng = np.random.default_rng(1)
    B, H, T, D = 2, 3, 7, 16
    x = rng.standard_normal((B, H, T, D))
    positions = np.array([[0, 5, 9, 80, 3, 200, 1], [4, 4, 2, 0, 150, 7, 60]])[:, None, :]  # (B, 1, T)
    dout = rng.standard_normal((B, H, T, D))
    w, factor = F.rope_inverse_frequency(D, 10000.0, scaling)
    out, cache = F.rope_forward(x, positions, inverse_frequency=w, attention_factor=factor)
    dx = F.rope_backward(dout, cache)
    # transformers' rotary embedding and apply_rotary_pos_emb, in float64
    xt = torch.tensor(x, requires_grad=True)
    angles = torch.tensor(positions, dtype=torch.float64)[..., None] * torch.tensor(w)  # (B, 1, T, D/2)
    emb = torch.cat((angles, angles), dim=-1)  # (B, 1, T, D)
    cos, sin = emb.cos() * factor, emb.sin() * factor
    expected = xt * cos + rotate_half(torch, xt) * sin
    expected.backward(torch.tensor(dout))
    assert out.shape == x.shape and dx.shape == x.shape
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=0, atol=1e-10)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("scaling", [LLAMA3[0], YARN[1]], ids=["llama3", "yarn"])
def test_scaled_rope_complex_step_certificate(layout, scaling):
    rng = np.random.default_rng(3)
    w, factor = F.rope_inverse_frequency(8, 10000.0, scaling)
    kwargs = {"positions": np.array([3, 0, 70, 1, 200]), "layout": layout,
              "inverse_frequency": w, "attention_factor": factor}
    report = check_op(F.rope_forward, F.rope_backward, {"x": rng.standard_normal((2, 5, 8))},
                      forward_kwargs=kwargs, method="complex_step")
    assert report.rows and report.ok, report


@pytest.mark.parametrize("scaling, error, words", [
    ("linear", TypeError, "scaling must be None or a mapping"),
    ({"rope_type": "dynamic", "factor": 2.0}, ValueError, "'rope_type' must be one of"),
    ({"rope_type": "linear", "type": "yarn", "factor": 2.0}, ValueError, "disagree"),
    ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, ValueError,
     "unknown key(s) ['low_freq_factor']"),
    ({"rope_type": "linear"}, ValueError, "misses required key(s) ['factor']"),
    ({"rope_type": "yarn", "factor": 2.0}, ValueError, "['original_max_position_embeddings']"),
    ({"rope_type": "linear", "factor": 0.0}, ValueError, "'factor' must be a positive finite"),
    ({"rope_type": "linear", "factor": "2"}, TypeError, "'factor' must be a number, got str"),
    ({"rope_type": "linear", "factor": True}, TypeError, "'factor' must be a number, got bool"),
    ({**LLAMA3[0], "high_freq_factor": 1.0}, ValueError, "'high_freq_factor' must be greater"),
    ({**LLAMA3[0], "original_max_position_embeddings": 64.5}, TypeError,
     "'original_max_position_embeddings' must be an int"),
    ({**YARN[0], "truncate": 1}, TypeError, "'truncate' must be a bool"),
    ({**YARN[0], "beta_fast": -1.0}, ValueError, "'beta_fast' must be a positive"),
    ({**YARN[0], "attention_factor": float("nan")}, ValueError, "'attention_factor' must be"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 5.0}, ValueError,
     "'rope_theta' must equal base"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, ValueError,
     "'partial_rotary_factor' must be 1.0"),
])
def test_bad_scaling_refused_by_name(scaling, error, words):
    with pytest.raises(error) as raised:
        F.rope_inverse_frequency(8, 10000.0, scaling)
    assert words in str(raised.value)


def test_bad_head_dim_base_and_rope_forward_arguments_refused_by_name():
    with pytest.raises(ValueError, match="head_dim must be even, got 7"):
        F.rope_inverse_frequency(7)
    with pytest.raises(TypeError, match="head_dim must be an int"):
        F.rope_inverse_frequency(8.0)
    with pytest.raises(ValueError, match="base must be a positive finite number"):
        F.rope_inverse_frequency(8, -1.0)
    x = np.zeros((3, 8))
    with pytest.raises(ValueError, match=r"inverse_frequency must have shape \(D/2,\) = \(4,\)"):
        F.rope_forward(x, inverse_frequency=np.ones(8))
    with pytest.raises(ValueError, match="inverse_frequency must be finite"):
        F.rope_forward(x, inverse_frequency=np.array([1.0, np.inf, 1.0, 1.0]))
    with pytest.raises(TypeError, match="inverse_frequency must hold real numbers"):
        F.rope_forward(x, inverse_frequency=np.ones(4, dtype=complex))
    for bad in (0.0, -1.0, float("inf"), "1", None):
        with pytest.raises(ValueError, match="attention_factor must be a positive finite number"):
            F.rope_forward(x, attention_factor=bad)
