"""Hypothesis strategies for the gradient proofs: small shapes, finite inputs, masks.

Shape key: B batch, H heads, T query length, S key length, E embedding,
D head dim of queries and keys, Dv head dim of values, N/M linear in/out.

Every strategy draws bounded finite floats (no NaN, no inf, no subnormals)
and tiny sizes (B <= 2, T, S <= 5, E <= 8) so that an elementwise central
difference check stays cheap. Square shapes hide transposes, so the
attention cases draw ``T != S`` and ``Dv != D``. Masks come in every kind
the API accepts: boolean (True = may attend) with fully masked rows, float
(added to the scores, with ``-inf`` entries, sometimes a whole row), causal,
and key padding masks that pad whole sequences.
"""
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

BOUND = 2.0

sizes = st.integers(1, 5)


def finite_arrays(shape, bound=BOUND):
    """float64 arrays of ``shape`` with entries in ``[-bound, bound]``."""
    elements = st.floats(-bound, bound, allow_nan=False, allow_infinity=False,
                         allow_subnormal=False, width=64)
    return hnp.arrays(np.float64, shape, elements=elements)


@st.composite
def distinct_pair(draw, low=1, high=5):
    """Two different ints in ``[low, high]`` (e.g. ``T != S``, ``D != Dv``)."""
    first = draw(st.integers(low, high))
    second = draw(st.integers(low, high - 1))
    return first, second + (second >= first)  # skip ``first``: no rejection


@st.composite
def bool_masks(draw, shape, fully_masked_rows=True):
    """Boolean ``shape`` mask (True = may attend); may hold fully masked rows."""
    keep = draw(hnp.arrays(np.bool_, shape))
    if fully_masked_rows and keep.size and draw(st.booleans()):
        index = draw(st.tuples(*(st.integers(0, n - 1) for n in shape[:-1])))
        keep[index] = False  # a query row with no key left
    return keep


@st.composite
def float_masks(draw, shape):
    """Additive float ``shape`` mask: finite values, some ``-inf``, maybe a ``-inf`` row."""
    bias = draw(finite_arrays(shape, bound=3.0))
    bias[draw(hnp.arrays(np.bool_, shape))] = -np.inf
    if bias.size and draw(st.booleans()):
        index = draw(st.tuples(*(st.integers(0, n - 1) for n in shape[:-1])))
        bias[index] = -np.inf
    return bias


MASK_KINDS = ("none", "bool", "float")


@st.composite
def masks(draw, shape, kind=None):
    """None, a bool mask or a float mask of ``shape`` (``kind`` drawn when None)."""
    kind = kind or draw(st.sampled_from(MASK_KINDS))
    if kind == "bool":
        return draw(bool_masks(shape))
    if kind == "float":
        return draw(float_masks(shape))
    return None


@st.composite
def broadcast_to_lead(draw, lead):
    """A shape that broadcasts to ``lead``: some dims set to 1, some leading dims dropped."""
    shape = [n if draw(st.booleans()) else 1 for n in lead]
    drop = draw(st.integers(0, len(shape)))
    return tuple(shape[drop:])


@st.composite
def linear_cases(draw):
    """``{"x": (..., N), "W": (N, M)}`` and maybe ``"b": (M,)``; N != M."""
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple))
    N, M = draw(distinct_pair(1, 5))
    inputs = {"x": draw(finite_arrays(lead + (N,))), "W": draw(finite_arrays((N, M)))}
    if draw(st.booleans()):
        inputs["b"] = draw(finite_arrays((M,)))
    return inputs


@st.composite
def softmax_cases(draw):
    """``(scores, keep, axis)``: finite scores, a bool ``keep`` mask (maybe None), any axis.

    ``keep`` may remove whole lines along ``axis`` (fully masked rows).
    """
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    scores = draw(finite_arrays(shape, bound=4.0))
    keep = None
    if draw(st.booleans()):
        keep = draw(hnp.arrays(np.bool_, shape))
        if draw(st.booleans()):
            line = [draw(st.integers(0, n - 1)) for n in shape]
            line[axis] = slice(None)
            keep[tuple(line)] = False  # one fully masked line along axis
    return scores, keep, axis


@st.composite
def attention_cases(draw, mask_kind=None):
    """Inputs and options of ``attention_forward`` with broadcasting leading dims.

    Returns ``(inputs, options)``: ``inputs`` holds ``query (..., T, D)``,
    ``key (..., S, D)``, ``value (..., S, Dv)`` whose leading dims broadcast
    to a common ``lead`` (0 to 2 dims); ``options`` holds ``attn_mask``
    (None, bool or float as ``mask_kind`` says, else drawn; broadcastable to
    ``lead + (T, S)``), ``is_causal``
    and ``scale`` (None or a positive float). ``T != S`` and ``Dv != D``.
    """
    lead = tuple(draw(st.lists(st.integers(1, 2), min_size=0, max_size=2)))
    T, S = draw(distinct_pair(1, 5))
    D, Dv = draw(distinct_pair(1, 4))
    inputs = {
        "query": draw(finite_arrays(draw(broadcast_to_lead(lead)) + (T, D))),
        "key": draw(finite_arrays(draw(broadcast_to_lead(lead)) + (S, D))),
        "value": draw(finite_arrays(draw(broadcast_to_lead(lead)) + (S, Dv))),
    }
    lead = np.broadcast_shapes(*(a.shape[:-2] for a in inputs.values()))  # what is left
    mask_lead = draw(broadcast_to_lead(lead))
    options = {
        "attn_mask": draw(masks(mask_lead + (T, S), mask_kind)),
        "is_causal": draw(st.booleans()),
        "scale": draw(st.one_of(st.none(), st.floats(0.1, 2.0))),
    }
    return inputs, options


@st.composite
def head_cases(draw):
    """``(x, num_heads)`` with ``x`` of shape ``(..., T, E)`` and ``num_heads`` dividing ``E``."""
    H = draw(st.integers(1, 4))
    D = draw(st.integers(1, 8 // H))
    lead = tuple(draw(st.lists(st.integers(1, 2), min_size=0, max_size=2)))
    T = draw(sizes)
    return draw(finite_arrays(lead + (T, H * D))), H


@st.composite
def self_attention_cases(draw):
    """``SelfAttention`` settings: sizes, ``x (..., T, d_in)``, mask, causal, bias."""
    d_in, d_out = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    lead = tuple(draw(st.lists(st.integers(1, 2), min_size=0, max_size=1)))
    T = draw(sizes)
    return {
        "d_in": d_in,
        "d_out": d_out,
        "qkv_bias": draw(st.booleans()),
        "x": draw(finite_arrays(lead + (T, d_in))),
        "attn_mask": draw(masks(draw(broadcast_to_lead(lead)) + (T, T))),
        "is_causal": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


@st.composite
def key_padding_masks(draw, batch, S):
    """Bool ``batch + (S,)`` mask, True = real token; may pad a whole sequence."""
    real = draw(hnp.arrays(np.bool_, batch + (S,)))
    if draw(st.booleans()):
        real[...] = True
    if batch and draw(st.booleans()):
        real[draw(st.integers(0, batch[0] - 1))] = False  # a fully padded sequence
    return real


@st.composite
def mha_cases(draw, kind=None):
    """``MultiHeadAttention`` settings and inputs.

    ``kind`` is ``"self"`` (only ``query``), ``"cross"`` (query, key, value
    with ``S != T``, ``kdim``/``vdim`` possibly different from ``E``) or
    ``"key_only"`` (query and key; value omitted, so ``value = key`` and
    ``vdim == kdim``); drawn when None. ``attn_mask`` is None, ``(T, S)`` or
    ``(B, H or 1, T, S)``, bool or float; ``key_padding_mask`` is None or
    ``(B, S)``.
    """
    kind = kind or draw(st.sampled_from(["self", "cross", "key_only"]))
    H = draw(st.sampled_from([1, 2, 4]))
    E = H * draw(st.integers(1, 8 // H))
    batch = tuple(draw(st.lists(st.integers(1, 2), min_size=0, max_size=1)))
    if kind == "self":
        T = S = draw(sizes)
        kdim = vdim = E
    else:
        T, S = draw(distinct_pair(1, 5))
        kdim = draw(st.integers(1, 8))
        vdim = kdim if kind == "key_only" else draw(st.integers(1, 8))
    mask_shape = draw(st.sampled_from([(T, S), batch + (H, T, S), batch + (1, T, S)]))
    case = {
        "kind": kind,
        "embed_dim": E,
        "num_heads": H,
        "bias": draw(st.booleans()),
        "kdim": None if kdim == E and draw(st.booleans()) else kdim,
        "vdim": None if vdim == E and kind != "key_only" and draw(st.booleans()) else vdim,
        "seed": draw(st.integers(0, 2**16)),
        "inputs": [draw(finite_arrays(batch + (T, E)))],
        "attn_mask": draw(masks(mask_shape)),
        "is_causal": draw(st.booleans()),
        "key_padding_mask": draw(st.one_of(st.none(), key_padding_masks(batch, S))),
    }
    if kind == "key_only":
        case["vdim"] = case["kdim"]
    if kind != "self":
        case["inputs"].append(draw(finite_arrays(batch + (S, kdim))))
    if kind == "cross":
        case["inputs"].append(draw(finite_arrays(batch + (S, vdim))))
    return case
