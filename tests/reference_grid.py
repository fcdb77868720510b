"""A fixed grid of calls whose outputs and gradients are kept in ``tests/golden/reference_grid.npz``.

Usage (rewrites the file from the checkout's qkvnp; do it only when a change
of results is intended, and say so in the commit)::

    python tests/reference_grid.py

Each case is a function of a seeded Generator returning ``{name: array}``:
the functional ops' forwards and backwards, every layer on every path
(``reference``, ``fast``, ``tiled``, ``auto``) in float64 and float32, the
transformer block, the GPT's forward, backward, decoding and generated
tokens. ``tests/test_reference_grid.py`` recomputes them and compares: a
reorganisation of the code must leave every number as it was.

The file also records the machine it was made on (processor, numpy and its
BLAS): on that machine the comparison is bit for bit; elsewhere BLAS kernels
round differently and the comparison allows a few units in the last place.
"""
import json
import platform
import sys
from pathlib import Path

import numpy as np

import qkvnp
from qkvnp import functional as F
from qkvnp.losses import cross_entropy_backward, cross_entropy_forward

GRID_FILE = Path(__file__).resolve().parent / "golden" / "reference_grid.npz"
PATHS = ("reference", "fast", "tiled", "auto")
DTYPES = (np.float64, np.float32)
CASES = {}


def case(function):
    CASES[function.__name__] = function
    return function


def fingerprint():
    """What decides the last bits: the processor, numpy and the BLAS numpy runs on."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), "")
    except OSError:
        model = ""
    blas = ""
    try:
        from threadpoolctl import threadpool_info

        blas = ";".join(f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')}"
                        for i in threadpool_info() if i.get("user_api") == "blas")
    except ImportError:
        pass
    return {"processor": model or platform.processor(), "machine": platform.machine(),
            "numpy": np.__version__, "blas": blas}


def _normal(rng, shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------- the functional ops


@case
def attention_ops(rng):
    out = {}
    for dtype in DTYPES:
        tag = np.dtype(dtype).name
        q, k, v = (_normal(rng, s, dtype) for s in [(2, 3, 4, 5), (2, 3, 6, 5), (2, 3, 6, 3)])
        dout = _normal(rng, (2, 3, 4, 3), dtype)
        bool_mask = rng.random((2, 1, 4, 6)) > 0.3
        bool_mask[0, 0, 1] = False  # a fully masked row
        float_mask = np.where(rng.random((4, 6)) > 0.2, 0.0, -np.inf).astype(dtype)
        calls = {
            "plain": dict(),
            "bool": dict(attn_mask=bool_mask),
            "float_causal": dict(attn_mask=float_mask, is_causal=True),
            "bottom_right_scale": dict(is_causal="bottom_right", scale=0.7),
            "dropout_mask": dict(dropout_p=0.25, dropout_mask=rng.random((2, 3, 4, 6)) > 0.25),
        }
        for name, kwargs in calls.items():
            y, cache = F.attention_forward(q, k, v, **kwargs)
            grads = F.attention_backward(dout, cache)
            out[f"{tag}/{name}/out"] = y
            for label, g in zip("qkv", grads):
                out[f"{tag}/{name}/d{label}"] = g
        kg, vg = k[:, :1], v[:, :1]  # one key/value head for three query heads
        y, cache = F.attention_forward(q, kg, vg, is_causal=True, enable_gqa=True)
        for label, g in zip(("out", "dq", "dk", "dv"), (y,) + tuple(F.attention_backward(dout, cache))):
            out[f"{tag}/gqa/{label}"] = g
    return out


@case
def variant_ops(rng):
    from qkvnp.ops.positions import alibi_bias, alibi_slopes, relative_position_bucket

    out = {}
    q, k, v = (_normal(rng, s) for s in [(2, 4, 5, 4), (2, 2, 5, 4), (2, 2, 5, 4)])
    dout = _normal(rng, (2, 4, 5, 4))
    rotated, rope_cache = F.rope_forward(q, positions=np.arange(5))
    out["rope/out"] = rotated
    out["rope/dx"] = F.rope_backward(dout, rope_cache)
    table = _normal(rng, (8, 4))  # (buckets, H)
    buckets = relative_position_bucket(5, 5, num_buckets=8, max_distance=16)  # (T, S)
    biases = {"alibi": alibi_bias(5, 5, alibi_slopes(4)),
              "t5": np.moveaxis(table[buckets], -1, 0)}  # (T, S, H) -> (H, T, S)
    calls = {
        "softcap": dict(softcap=2.0, is_causal=True),
        "sinks": dict(sinks=_normal(rng, (4,)), is_causal=True),
        "window": dict(window=(2, 0), is_causal=True),
        "alibi": dict(score_bias=biases["alibi"], is_causal=True),
        "t5": dict(score_bias=biases["t5"]),
    }
    for name, kwargs in calls.items():
        y, cache = F.attention_forward(q, k, v, enable_gqa=True, **kwargs)
        out[f"{name}/out"] = y
        for i, g in enumerate(F.attention_backward(dout, cache)):
            if g is not None:
                out[f"{name}/grad{i}"] = np.asarray(g)
    return out


@case
def block_ops(rng):
    out = {}
    for dtype in DTYPES:
        tag = np.dtype(dtype).name
        x = _normal(rng, (2, 3, 8), dtype)
        dout = _normal(rng, (2, 3, 8), dtype)
        scale, shift = _normal(rng, (8,), dtype), _normal(rng, (8,), dtype)
        y, cache = F.layer_norm_forward(x, scale, shift, 1e-5)
        out[f"{tag}/layer_norm/out"] = y
        for i, g in enumerate(F.layer_norm_backward(dout, cache)):
            out[f"{tag}/layer_norm/grad{i}"] = g
        for approximate in ("tanh", "none"):
            y, cache = F.gelu_forward(x, approximate)
            out[f"{tag}/gelu_{approximate}/out"] = y
            out[f"{tag}/gelu_{approximate}/dx"] = F.gelu_backward(dout, cache)
        W, b = _normal(rng, (8, 6), dtype), _normal(rng, (6,), dtype)
        y, cache = F.linear_forward(x, W, b)
        out[f"{tag}/linear/out"] = y
        for i, g in enumerate(F.linear_backward(_normal(rng, (2, 3, 6), dtype), cache)):
            out[f"{tag}/linear/grad{i}"] = g
        heads, cache = F.split_heads_forward(x, 2)
        out[f"{tag}/split/out"] = heads
        out[f"{tag}/split/dx"] = F.split_heads_backward(_normal(rng, heads.shape, dtype), cache)
        table = _normal(rng, (11, 8), dtype)
        ids = rng.integers(0, 11, (2, 3))
        y, cache = F.embedding_forward(ids, table)
        out[f"{tag}/embedding/out"] = y
        out[f"{tag}/embedding/dtable"] = F.embedding_backward(dout, cache)
        logits, targets = _normal(rng, (2, 3, 11), dtype), rng.integers(0, 11, (2, 3))
        loss, cache = cross_entropy_forward(logits, targets)
        out[f"{tag}/cross_entropy/loss"] = np.asarray(loss)
        out[f"{tag}/cross_entropy/dlogits"] = cross_entropy_backward(1.0, cache)
        y, cache = F.softmax_forward(logits)
        out[f"{tag}/softmax/out"] = y
        out[f"{tag}/softmax/dx"] = F.softmax_backward(_normal(rng, y.shape, dtype), cache)
    return out


# ---------------------------------------------------------------- the layers, every path


LAYERS = {
    "mha_causal": (lambda impl, dtype: qkvnp.MultiHeadAttention(8, 2, rng=0, impl=impl, dtype=dtype),
                   dict(is_causal=True)),
    "mha_gqa": (lambda impl, dtype: qkvnp.MultiHeadAttention(8, 4, num_kv_heads=2, rng=0, impl=impl,
                                                            dtype=dtype), dict(is_causal=True)),
    "mha_variants": (lambda impl, dtype: qkvnp.MultiHeadAttention(
        8, 2, rng=0, impl=impl, dtype=dtype, rope=True, softcap=5.0, sinks=True,
        window=(3, 0)), dict(is_causal=True)),
    "mha_alibi": (lambda impl, dtype: qkvnp.MultiHeadAttention(
        8, 2, rng=0, impl=impl, dtype=dtype, position_bias="alibi"), dict(is_causal=True)),
    "mha_t5": (lambda impl, dtype: qkvnp.MultiHeadAttention(
        8, 2, rng=0, impl=impl, dtype=dtype, position_bias="relative", num_buckets=8,
        max_distance=16),
        dict()),
    "self_attention": (lambda impl, dtype: qkvnp.SelfAttention(8, 6, qkv_bias=True, rng=0,
                                                               impl=impl, dtype=dtype),
                       dict()),
}


@case
def layers(rng):
    out = {}
    for dtype in DTYPES:
        tag = np.dtype(dtype).name
        x = _normal(rng, (2, 7, 8), dtype)
        for name, (build, kwargs) in LAYERS.items():
            for impl in PATHS:
                layer = build(impl, dtype)
                y = layer.forward(x, **kwargs)
                dout = np.random.default_rng(1).standard_normal(y.shape).astype(dtype)
                out[f"{tag}/{name}/{impl}/out"] = y
                out[f"{tag}/{name}/{impl}/dx"] = layer.backward(dout)
                for param, g in layer.grads.items():
                    out[f"{tag}/{name}/{impl}/{param}"] = g
    return out


@case
def cross_attention(rng):
    out = {}
    q, kv = _normal(rng, (2, 4, 8)), _normal(rng, (2, 6, 5))
    padding = np.zeros((2, 6), bool)
    padding[1, -2:] = True
    for impl in PATHS:
        layer = qkvnp.MultiHeadAttention(8, 2, kdim=5, vdim=5, rng=0, impl=impl)
        y, weights = layer.forward(q, kv, kv, key_padding_mask=padding,
                                   return_weights=True)
        out[f"{impl}/out"], out[f"{impl}/weights"] = y, weights
        dq, dk, dv = layer.backward(np.random.default_rng(2).standard_normal(y.shape))
        out[f"{impl}/dq"], out[f"{impl}/dk"], out[f"{impl}/dv"] = dq, dk, dv
    return out


# ---------------------------------------------------------------- the models


def _gpt(dtype, **options):
    return qkvnp.GPTModel(vocab_size=17, context_length=10, emb_dim=8, num_heads=2, num_layers=2,
                          rng=0, dtype=dtype, **options)


@case
def gpt(rng):
    out = {}
    for dtype in DTYPES:
        for variant, options in {"book": {}, "variants": dict(rope=True, window=(3, 0),
                                                               num_kv_heads=1)}.items():
            tag = f"{np.dtype(dtype).name}/{variant}"
            model = _gpt(dtype, **options)
            idx = rng.integers(0, 17, (2, 6))
            logits = model.forward(idx)
            model.backward(np.random.default_rng(3).standard_normal(logits.shape).astype(dtype))
            out[f"{tag}/logits"] = logits
            for name, g in model.grads.items():
                out[f"{tag}/{name}"] = g
            caches = [qkvnp.KVCache() for _ in range(model.num_layers)]
            steps = [model.decode(idx[:, :3], caches)] + [model.decode(idx[:, t:t + 1], caches)
                                                          for t in range(3, 6)]
            out[f"{tag}/decoded"] = np.concatenate(steps, axis=1)
            out[f"{tag}/greedy"] = qkvnp.generate(model, idx[:, :2], 9)
            out[f"{tag}/sampled"] = qkvnp.generate(model, idx[:, :2], 9, temperature=0.9,
                                                   top_k=5, rng=4)
    return out


@case
def transformer_block(rng):
    out = {}
    for dtype in DTYPES:
        tag = np.dtype(dtype).name
        block = qkvnp.TransformerBlock(8, 2, dropout=0.2, rng=0, dtype=dtype)
        x = _normal(rng, (2, 5, 8), dtype)
        y = block.forward(x)  # training mode: masks drawn from the block's Generators
        out[f"{tag}/out"] = y
        out[f"{tag}/dx"] = block.backward(_normal(rng, y.shape, dtype))
        for name, g in block.grads.items():
            out[f"{tag}/{name}"] = g
    return out


def compute():
    """``{case/name: array}`` of every case, each drawn from its own seed."""
    arrays = {}
    for seed, (name, function) in enumerate(CASES.items()):
        for key, value in function(np.random.default_rng(seed)).items():
            arrays[f"{name}/{key}"] = np.asarray(value)
    return arrays


def main():
    from qkvnp._io import atomic_write

    arrays = compute()
    arrays["__fingerprint__"] = np.array(json.dumps(fingerprint()))
    with atomic_write(GRID_FILE) as f:
        np.savez_compressed(f, **arrays)
    print(f"wrote {len(arrays) - 1} arrays to {GRID_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
