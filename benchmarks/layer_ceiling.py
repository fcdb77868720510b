"""The floor of a layer's forward+backward: its matrix products alone, against the whole layer and PyTorch's.

Usage: ``python benchmarks/layer_ceiling.py [B,L,E,H ...] [--dtype float32] [--causal]``
(default: (8, 128, 256, 8), (4, 512, 512, 8), (1, 2048, 512, 8), (1, 4096, 256, 4)).

Shape key: B batch, L sequence length, E embedding, H heads, D = E / H head
dim; N = B * L rows; bq, bk the tiled core's block sizes.

``MultiHeadAttention`` with ``impl="auto"`` runs the fast dense core below
``tiled_min_length`` keys (``causal_tiled_min_length`` under a causal mask)
and the tiled core from there (``qkvnp.kernels.choose_path``). Either way
its forward+backward issues the same projection products, (N, E) x (E, 3E)
in and (N, E) x (E, E) out, with their two gradients each, and the core's:
the dense core forms Q K^T and P V forward, and dV, dP, dQ, dK backward, on
the whole (B*H, L, L) scores (under a causal mask, by chunks of
``causal_row_block`` rows, each on the keys its last row sees); the tiled core forms Q K^T and P V for every
live (bq, bk) block pair forward, and Q K^T, dV, dP, dQ, dK again backward
(a causal mask skips the pairs above the diagonal). This script issues
exactly those products on random arrays of the same shapes and layouts, on
one BLAS thread, and reports their time, half of it (the floor on two cores
if the two threads shared the products perfectly, which they do not quite),
the whole layer's time on the default
two threads, and PyTorch's ``nn.MultiheadAttention`` (if installed), all in
this process, best of ``--rounds``. Whatever qkvnp does besides the products
(softmax passes, masks, Python) comes on top of the floor; when the floor
alone is near or above a target's time, numpy's BLAS is what stops the
target, not the rest.
"""
import argparse
import math
import os
import sys
import time

import numpy as np

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, CHECKOUT)  # this checkout's benchmarks package and qkvnp, installed or not

import qkvnp  # noqa: E402
from qkvnp.kernels import blas_threads, choose_path, get_block_sizes, get_num_threads  # noqa: E402

DEFAULT_CONFIGS = ((8, 128, 256, 8), (4, 512, 512, 8), (1, 2048, 512, 8), (1, 4096, 256, 4))


def tiled_blocks(lead_size, T, S, threads):
    """The tiled core's default blocks: ``tiled_block`` halved while a block
    holds more than 2**18 scores over the (batch, head) pairs, and at most
    ceil(L / threads) (not below 32), as ``qkvnp.kernels.tiled`` sizes them."""
    block_q, block_k = get_block_sizes()["tiled_block"]
    while lead_size * block_q * block_k > 1 << 18 and max(block_q, block_k) > 32:
        if block_k >= block_q:
            block_k //= 2
        else:
            block_q //= 2
    block_q = min(block_q, max(32, -(-T // threads)), T)
    block_k = min(block_k, max(32, -(-S // threads)), S)
    return block_q, block_k


def layer_products(x, W_in, W_out, q, k, v, path, causal, blocks):
    """The products of one layer forward+backward (values discarded).

    ``x`` (N, E); ``W_in`` (E, 3E); ``W_out`` (E, E); ``q``, ``k``, ``v``
    (B, H, L, D) views of a (N, 3E) projection, as the layer lays them out.
    """
    y = x @ W_in  # (N, E) @ (E, 3E): the fused projections
    merged = y[:, : W_out.shape[0]]
    merged @ W_out  # (N, E) @ (E, E): the output projection
    merged.T @ merged, merged @ W_out.T  # its weight and input gradients
    if path == "fast":
        # causal: chunks of causal_row_block rows, each on the keys its last row sees
        T, S = q.shape[-2], k.shape[-2]
        rows = min(T, get_block_sizes()["causal_row_block"]) if causal else T
        for i0 in range(0, T, rows):
            live = min(S, i0 + rows) if causal else S
            qc, kc, vc = q[..., i0:i0 + rows, :], k[..., :live, :], v[..., :live, :]
            scores = qc @ kc.swapaxes(-1, -2)  # (B, H, R, D) @ (B, H, D, live)
            scores @ vc  # P V
            scores.swapaxes(-1, -2) @ qc, qc @ vc.swapaxes(-1, -2)  # dV, dP
            scores @ kc, scores.swapaxes(-1, -2) @ qc  # dQ, dK
    else:
        T, S = q.shape[-2], k.shape[-2]
        block_q, block_k = blocks
        for backward in (False, True):
            for i0 in range(0, T, block_q):
                qb = q[..., i0:i0 + block_q, :]
                for j0 in range(0, S, block_k):
                    if causal and j0 > min(i0 + block_q, T) - 1:  # above the diagonal: skipped
                        continue
                    kb, vb = k[..., j0:j0 + block_k, :], v[..., j0:j0 + block_k, :]
                    scores = qb @ kb.swapaxes(-1, -2)  # (B, H, bq, D) @ (B, H, D, bk)
                    if not backward:
                        scores @ vb  # P V
                    else:
                        scores.swapaxes(-1, -2) @ qb, qb @ vb.swapaxes(-1, -2)  # dV, dP
                        scores @ kb, scores.swapaxes(-1, -2) @ qb  # dQ, dK
    x.T @ y, y @ W_in.T  # the input projections' weight and input gradients


def best_time(call, rounds, min_time=0.2):
    """Best of ``rounds`` rounds, each of enough calls to last ``min_time`` s; seconds per call."""
    call()
    start = time.perf_counter()
    call()
    calls = max(1, int(min_time / max(time.perf_counter() - start, 1e-9)))
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def measure(config, dtype, causal, rounds):
    B, L, E, H = config
    D = E // H
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B * L, E)).astype(dtype)
    W_in = rng.standard_normal((E, 3 * E)).astype(dtype)
    W_out = rng.standard_normal((E, E)).astype(dtype)
    projected = rng.standard_normal((B * L, 3 * E)).astype(dtype)
    q, k, v = (projected[:, i * E:(i + 1) * E].reshape(B, L, H, D).swapaxes(1, 2)
               for i in range(3))  # (N, E) -> (B, H, L, D) views, as the layer's heads
    path = choose_path("auto", B * H, L, L, dtype, is_causal=causal).path
    blocks = tiled_blocks(B * H, L, L, get_num_threads())
    with blas_threads(1):
        floor = best_time(lambda: layer_products(x, W_in, W_out, q, k, v, path, causal, blocks),
                          rounds)
    layer = qkvnp.MultiHeadAttention(E, H, dtype=dtype, rng=0)
    xs = rng.standard_normal((B, L, E)).astype(dtype)
    dout = rng.standard_normal((B, L, E)).astype(dtype)

    def qkvnp_step():
        layer(xs, is_causal=causal)
        layer.backward(dout)

    ours = best_time(qkvnp_step, rounds)
    theirs = None
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        time.sleep(0.3)  # idle threads of the other library stop spinning
        tdtype = torch.float32 if dtype == np.float32 else torch.float64
        mha = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=tdtype)
        tx = torch.tensor(xs, requires_grad=True)
        tdout = torch.tensor(dout)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=tdtype) if causal else None

        def torch_step():
            out, _ = mha(tx, tx, tx, need_weights=False, attn_mask=mask, is_causal=causal)
            out.backward(tdout)

        theirs = best_time(torch_step, rounds)
    return path, blocks, floor, ours, theirs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", metavar="B,L,E,H")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    configs = [tuple(int(n) for n in c.split(",")) for c in args.configs] or DEFAULT_CONFIGS
    dtype = np.dtype(args.dtype)
    mask = "causal" if args.causal else "no mask"
    print(f"{dtype.name}, {mask}, best of {args.rounds} rounds, times of one forward+backward in ms")
    print(f"{'(B, L, E, H)':18} {'path':6} {'products, 1 thread':>19} {'/ 2':>8} "
          f"{'qkvnp':>8} {'PyTorch':>8} {'floor / PyTorch':>16}")
    for config in configs:
        path, blocks, floor, ours, theirs = measure(config, dtype, args.causal, args.rounds)
        ratio = "" if theirs is None else f"{floor / 2 / theirs:16.2f}"
        torch_ms = "" if theirs is None else f"{1e3 * theirs:8.1f}"
        label = path if path == "fast" else f"tiled {blocks[0]}x{blocks[1]}"
        print(f"{str(config):18} {label:6} {1e3 * floor:19.1f} {1e3 * floor / 2:8.1f} "
              f"{1e3 * ours:8.1f} {torch_ms:>8} {ratio}")


if __name__ == "__main__":
    main()
