"""The mixture of experts computes only the chosen experts: top-k of X against all X, forward+backward.

Usage::

    python benchmarks/moe_bench.py [--emb 256] [--hidden 128] [--experts 8] [--top-k 2]
                                   [--batch 8] [--tokens 128] [--threads 1 2] [--rounds 31]

``MoEFeedForward(E, F, X, k)`` float32 on ``x`` of (B, T, E), one forward and
one backward (a fixed random upstream gradient), against the same layer, the
same weights, with ``top_k = X``: every expert computes every token, which is
"all X experts dense" in the same library (the same router, gathers and
scatter-adds; only the routing differs). Target: at most 0.4x at top-2 of 8.

The two layers are alternated call by call in one process (a host whose
speed drifts moves both alike), after a warm-up, at each ``--threads`` count
(BLAS and qkvnp's kernels, ``qkvnp.kernels.blas_threads``/``num_threads``);
reported: the median of each and their ratio. Beside them, the floor the
experts' matrix products set: the 9 products an expert issues in a
forward+backward (3 forward, 6 backward) at the token counts the router gave
each expert, on random arrays, timed the same way; their ratio is what BLAS
allows the layer's ratio to be (at k / X of the rows, small products run
below the large ones' rate).

Default sizes: width 256 and Qwen3-MoE's proportions (``hidden_size`` 2048,
``moe_intermediate_size`` 768: F = 3E/8 = 96 at E = 256; 128 is the nearest
multiple of the vector width, and ``--hidden 256`` the wider case); 8 x 128
tokens as the issue's training step. Fixed seeds; the host's load is not
controlled: run it on an idle machine.
"""
import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, CHECKOUT)  # this checkout's benchmarks package and qkvnp, installed or not

import qkvnp  # noqa: E402
from qkvnp.kernels import blas_threads, num_threads  # noqa: E402
from qkvnp.layers import MoEFeedForward  # noqa: E402


def host():
    """The CPU's model name and the usable cores."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {len(os.sched_getaffinity(0))} usable cores"


def alternated_medians(steps, rounds, warmup=2):
    """Each step timed ``rounds`` times, the steps alternated call by call: ``{name: median s}``."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def layer_step(layer, x, dout):
    def step():
        layer.forward(x)
        layer.backward(dout)
        layer.zero_grad()
    return step


def products_step(counts, E, F, rng):
    """The experts' 9 matrix products of a forward+backward, at ``counts`` tokens an expert."""
    arrays = []
    for n in counts:
        if n == 0:
            continue
        x, dy = rng.standard_normal((2, n, E), dtype=np.float32)
        gate, hidden = rng.standard_normal((2, n, F), dtype=np.float32)
        W_gate, W_up = rng.standard_normal((2, E, F), dtype=np.float32)
        W_down = rng.standard_normal((F, E), dtype=np.float32)
        arrays.append((x, dy, gate, hidden, W_gate, W_up, W_down))

    def step():
        for x, dy, gate, hidden, W_gate, W_up, W_down in arrays:
            x @ W_gate, x @ W_up, hidden @ W_down  # forward
            dy @ W_down.T, hidden.T @ dy  # dhidden, dW_down
            gate @ W_up.T, x.T @ gate, gate @ W_gate.T, x.T @ gate  # dx_up, dW_up, dx_gate, dW_gate
    return step


def routed_counts(layer, x):
    """How many tokens the layer's router sends to each expert."""
    indices, _, _ = qkvnp.functional.router_forward(x.reshape(-1, layer.emb_dim),
                                                    layer.params["router.W"], layer.top_k,
                                                    layer.gating)
    return np.bincount(indices.ravel(), minlength=layer.num_experts)


def measure(args, threads):
    """``{"layer": (sparse s, dense s), "products": (sparse s, dense s), "counts": ...}``."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.tokens, args.emb), dtype=np.float32)
    dout = rng.standard_normal(x.shape, dtype=np.float32)
    sparse, dense = (MoEFeedForward(args.emb, args.hidden, args.experts, k, rng=0, dtype=np.float32)
                     for k in (args.top_k, args.experts))  # rng=0: the same weights
    counts = routed_counts(sparse, x)
    with blas_threads(threads), num_threads(threads):
        layer = alternated_medians({"sparse": layer_step(sparse, x, dout),
                                    "dense": layer_step(dense, x, dout)}, args.rounds)
        products = alternated_medians(
            {"sparse": products_step(counts, args.emb, args.hidden, rng),
             "dense": products_step([x.shape[0] * x.shape[1]] * args.experts, args.emb,
                                    args.hidden, rng)}, args.rounds)
    return {"layer": (layer["sparse"], layer["dense"]),
            "products": (products["sparse"], products["dense"]), "counts": counts}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emb", type=int, default=256, help="E, the width")
    parser.add_argument("--hidden", type=int, default=128, help="F, an expert's hidden width")
    parser.add_argument("--experts", type=int, default=8, help="X")
    parser.add_argument("--top-k", type=int, default=2, help="k, experts a token")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128, help="T, tokens a sequence")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=31, help="timed calls of each (median)")
    args = parser.parse_args(argv)
    print(f"host: {host()}; numpy {np.__version__}, qkvnp {qkvnp.__version__}")
    print(f"MoEFeedForward E={args.emb} F={args.hidden} X={args.experts}, x ({args.batch}, "
          f"{args.tokens}, {args.emb}) float32, forward+backward, median of {args.rounds}")
    print(f"{'threads':>7s} {'top-' + str(args.top_k):>10s} {'top-' + str(args.experts):>10s} "
          f"{'ratio':>6s}   {'products':>10s} {'dense':>10s} {'ratio':>6s}")
    for threads in args.threads:
        result = measure(args, threads)
        (sparse, dense), (floor_sparse, floor_dense) = result["layer"], result["products"]
        print(f"{threads:7d} {sparse * 1e3:7.2f} ms {dense * 1e3:7.2f} ms {sparse / dense:6.3f}"
              f"   {floor_sparse * 1e3:7.2f} ms {floor_dense * 1e3:7.2f} ms "
              f"{floor_sparse / floor_dense:6.3f}")
    print(f"tokens an expert at top-{args.top_k}: {result['counts'].tolist()} "
          f"(target: the layer's ratio <= 0.4 at top-2 of 8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
