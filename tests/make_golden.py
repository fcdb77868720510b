"""Regenerate the PyTorch golden values in ``tests/golden/*.npz``.

Usage (needs PyTorch; the tests that read the files do not)::

    python tests/make_golden.py

Each case draws its inputs, weights and upstream gradient from a fixed numpy
seed, runs them through PyTorch in float64 (``scaled_dot_product_attention``
or ``nn.MultiheadAttention(batch_first=True)``), and stores inputs, masks,
weights (in qkvnp's ``x @ W`` layout), the upstream gradient ``dout``, the
output, the attention weights and every gradient. Only plain numeric and bool
arrays are stored (no object arrays), so ``np.load(..., allow_pickle=False)``
reads them. Files are written atomically (temp file, fsync, ``os.replace``).

Shape key: B batch, H heads, T query length, S key length, E embedding,
D head dim, Dv value head dim.

This is a script, not a test module: pytest does not collect it (its name
does not start with ``test_``), and importing it does not import PyTorch.
"""
import argparse
from pathlib import Path

import numpy as np

from qkvnp._io import atomic_write

from oracles import load_into_torch_mha, torch_mha_param_grads

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"

# name -> SDPA settings; the numpy seed is the position in this dict
SDPA_CASES = {
    # (B, H, T, D) x (B, H, S, D), no mask, default scale
    "sdpa_plain": dict(q=(2, 3, 4, 5), k=(2, 3, 6, 5), v=(2, 3, 6, 3), mask=None,
                       is_causal=False, scale=None),
    # bool mask broadcast over heads, one fully masked query row, custom scale
    "sdpa_bool_mask": dict(q=(2, 2, 4, 3), k=(2, 2, 5, 3), v=(2, 2, 5, 4), mask=("bool", (2, 1, 4, 5)),
                           is_causal=False, scale=0.7),
    # float mask with -inf entries combined with is_causal, T < S
    "sdpa_float_mask_causal": dict(q=(3, 4, 3), k=(3, 6, 3), v=(3, 6, 2), mask=("float", (4, 6)),
                                   is_causal=True, scale=None),
    # unbatched, causal, T > S
    "sdpa_causal_unbatched": dict(q=(5, 4), k=(3, 4), v=(3, 6), mask=None, is_causal=True,
                                  scale=None),
}

# name -> MultiHeadAttention settings
MHA_CASES = {
    # self-attention with biases, causal
    "mha_self_causal": dict(E=6, H=2, kdim=None, vdim=None, bias=True, B=2, T=5, S=5,
                            cross=False, attn_mask=None, is_causal=True, padding=False),
    # cross-attention, kdim/vdim != E, key padding (one batch element fully padded
    # out), a bool (T, S) attention mask, no biases
    "mha_cross_padding": dict(E=6, H=3, kdim=4, vdim=5, bias=False, B=3, T=4, S=5,
                              cross=True, attn_mask="bool", is_causal=False, padding=True),
    # cross-attention with biases and a per-head float mask
    "mha_cross_float_mask": dict(E=8, H=4, kdim=None, vdim=None, bias=True, B=2, T=3, S=4,
                                 cross=True, attn_mask="float", is_causal=False, padding=False),
}


def save_npz_atomic(path, arrays):
    """Write ``arrays`` to ``path`` as .npz atomically (temp file, fsync, replace)."""
    for name, value in arrays.items():
        if np.asarray(value).dtype == object:
            raise TypeError(f"{name}: object arrays cannot be stored, got {type(value).__name__}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        np.savez(f, **arrays)


def _causal(T, S):
    return np.tril(np.ones((T, S), dtype=bool))


def make_sdpa_case(torch, seed, spec):
    """Inputs and torch float64 results for one SDPA case."""
    rng = np.random.default_rng(seed)
    arrays = {n: rng.normal(size=spec[n[0]]) for n in ("query", "key", "value")}
    T, S = spec["q"][-2], spec["k"][-2]
    mask = None
    if spec["mask"] is not None:
        kind, shape = spec["mask"]
        if kind == "bool":
            mask = rng.random(shape) < 0.6
            mask[(0,) * (len(shape) - 2) + (1,)] = False  # a fully masked query row
        else:
            mask = rng.normal(size=shape)
            mask[rng.random(shape) < 0.25] = -np.inf
        arrays["attn_mask"] = mask
    arrays["dout"] = rng.normal(size=np.broadcast_shapes(spec["q"][:-2], spec["k"][:-2])
                                + (T, spec["v"][-1]))
    arrays["is_causal"] = np.array(spec["is_causal"])
    if spec["scale"] is not None:
        arrays["scale"] = np.array(spec["scale"])

    # torch refuses attn_mask together with is_causal: give it the combination
    torch_mask, is_causal = mask, spec["is_causal"]
    if mask is not None and is_causal:
        torch_mask = (mask & _causal(T, S) if mask.dtype == np.bool_
                      else np.where(_causal(T, S), mask, -np.inf))
        is_causal = False
    q, k, v = (torch.tensor(arrays[n], requires_grad=True) for n in ("query", "key", "value"))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=None if torch_mask is None else torch.tensor(torch_mask),
        is_causal=is_causal, scale=spec["scale"])
    out.backward(torch.tensor(arrays["dout"]))
    with torch.no_grad():  # the weights, written out; 0 on fully masked rows
        scale = spec["scale"] or 1.0 / np.sqrt(spec["q"][-1])
        scores = q @ k.transpose(-1, -2) * scale
        allowed = torch_mask if torch_mask is not None else (_causal(T, S) if is_causal else None)
        if allowed is not None and allowed.dtype == np.bool_:
            scores = scores.masked_fill(~torch.tensor(allowed), float("-inf"))
        elif allowed is not None:
            scores = scores + torch.tensor(allowed)
        weights = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    arrays.update(out=out.detach().numpy(), weights=weights.numpy(), dquery=q.grad.numpy(),
                  dkey=k.grad.numpy(), dvalue=v.grad.numpy())
    return arrays


def make_mha_case(torch, seed, spec):
    """Inputs, weights (qkvnp layout) and torch float64 results for one MHA case."""
    rng = np.random.default_rng(seed)
    E, H, B, T, S = spec["E"], spec["H"], spec["B"], spec["T"], spec["S"]
    kdim, vdim = spec["kdim"] or E, spec["vdim"] or E
    params = {
        "W_query": rng.normal(size=(E, E)) / np.sqrt(E),
        "W_key": rng.normal(size=(kdim, E)) / np.sqrt(kdim),
        "W_value": rng.normal(size=(vdim, E)) / np.sqrt(vdim),
        "W_out": rng.normal(size=(E, E)) / np.sqrt(E),
    }
    if spec["bias"]:
        params.update({n: rng.normal(size=E) for n in ("b_query", "b_key", "b_value", "b_out")})
    arrays = {"query": rng.normal(size=(B, T, E))}
    if spec["cross"]:
        arrays["key"] = rng.normal(size=(B, S, kdim))
        arrays["value"] = rng.normal(size=(B, S, vdim))
    arrays["dout"] = rng.normal(size=(B, T, E))
    arrays["num_heads"] = np.array(H)
    arrays["is_causal"] = np.array(spec["is_causal"])

    # our masks, then torch's (True = ignore; per-head masks as (B*H, T, S))
    torch_mask = None
    if spec["attn_mask"] == "bool":
        arrays["attn_mask"] = rng.random((T, S)) < 0.8
        torch_mask = torch.tensor(~arrays["attn_mask"])
    elif spec["attn_mask"] == "float":
        arrays["attn_mask"] = rng.normal(size=(B, H, T, S))
        torch_mask = torch.tensor(arrays["attn_mask"].reshape(B * H, T, S))
    if spec["is_causal"]:
        torch_mask = torch.tensor(~_causal(T, S))  # torch needs it with is_causal
    torch_padding = None
    if spec["padding"]:
        padding = rng.random((B, S)) < 0.7
        padding[0] = True
        padding[-1] = False  # a batch element with every key padded out
        arrays["key_padding_mask"] = padding
        torch_padding = torch.tensor(~padding)

    layer = torch.nn.MultiheadAttention(E, H, bias=spec["bias"], kdim=kdim, vdim=vdim,
                                        batch_first=True, dtype=torch.float64)
    load_into_torch_mha(torch, layer, params)
    query = torch.tensor(arrays["query"], requires_grad=True)
    key = torch.tensor(arrays["key"], requires_grad=True) if spec["cross"] else query
    value = torch.tensor(arrays["value"], requires_grad=True) if spec["cross"] else query
    kwargs = dict(attn_mask=torch_mask, key_padding_mask=torch_padding,
                  is_causal=spec["is_causal"], average_attn_weights=False)
    # need_weights=False runs torch's SDPA, which defines fully masked rows as 0
    out, _ = layer(query, key, value, need_weights=False, **kwargs)
    out.backward(torch.tensor(arrays["dout"]))
    with torch.no_grad():
        _, weights = layer(query, key, value, need_weights=True, **kwargs)
    arrays.update(out=out.detach().numpy(), weights=np.nan_to_num(weights.numpy(), nan=0.0))
    if spec["cross"]:
        arrays.update(dquery=query.grad.numpy(), dkey=key.grad.numpy(), dvalue=value.grad.numpy())
    else:
        arrays["dx"] = query.grad.numpy()
    grads = {n: g.numpy() for n, g in torch_mha_param_grads(layer, E).items()}
    arrays.update({f"param_{n}": a for n, a in params.items()})
    arrays.update({f"grad_{n}": np.ascontiguousarray(a) for n, a in grads.items()})
    return arrays


def main(argv=None):
    """Write every golden case; return 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=GOLDEN_DIR)
    args = parser.parse_args(argv)
    import torch  # only this script needs it

    torch.manual_seed(0)
    cases = [(name, make_sdpa_case, spec) for name, spec in SDPA_CASES.items()]
    cases += [(name, make_mha_case, spec) for name, spec in MHA_CASES.items()]
    for seed, (name, make, spec) in enumerate(cases):
        arrays = make(torch, seed, spec)
        for key, value in arrays.items():
            if np.asarray(value).dtype.kind not in "biuf":
                raise TypeError(f"{name}/{key}: non-numeric array ({np.asarray(value).dtype})")
            if not np.isfinite(np.asarray(value, dtype=float)).all() and key != "attn_mask":
                raise ValueError(f"{name}/{key}: torch produced NaN/inf")
        path = args.out_dir / f"{name}.npz"
        save_npz_atomic(path, arrays)
        print(f"wrote {path} ({path.stat().st_size} bytes, torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
