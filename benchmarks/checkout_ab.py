"""Whether a change of the code slowed qkvnp: the same timings in two checkouts, alternated.

Usage::

    python benchmarks/checkout_ab.py --json new-1.json           # in the changed checkout
    python OLD/benchmarks/checkout_ab.py --json old-1.json       # in the other one
    ... (alternate a few times)
    python benchmarks/checkout_ab.py --compare old-*.json -- new-*.json

Each run times, in the checkout it is run from, the multi-head layer's
forward+backward (float32, qkvnp's default path) at the small sizes where a
change of Python code shows first, and the book's GPT's AdamW step (float32,
``tiny`` and ``small``), each in 0.2 s rounds, the median of 7, all in one
process. A whole process can still land in a slower mode of the host, so
one timing's ratio moves from run to run: alternate several runs of each
side and read the median of the ratios. ``--compare`` prints, per timing,
the median over the runs of each side and their ratio (new / old), then the
median of the ratios.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

LAYER_CONFIGS = [(1, 6, 3, 1), (8, 16, 32, 4), (64, 8, 16, 2), (16, 32, 64, 4), (64, 33, 64, 1)]
GPT_CONFIGS = {"tiny": (256, 64, 64, 4, 2, 8), "small": (256, 128, 128, 4, 4, 8)}


def _median_ms(call, rounds=7, seconds=0.2):
    """Median over ``rounds`` of the mean time of ``call`` in rounds of ``seconds``."""
    means = []
    for _ in range(rounds):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            call()
            count += 1
        means.append((time.perf_counter() - start) / count)
    return statistics.median(means) * 1e3


def _layer_timing(config, causal):
    import qkvnp

    B, L, E, H = config
    layer = qkvnp.MultiHeadAttention(E, H, rng=0, dtype=np.float32)
    x = np.random.default_rng(0).standard_normal((B, L, E)).astype(np.float32)
    dout = np.random.default_rng(1).standard_normal((B, L, E)).astype(np.float32)

    def step():
        layer.forward(x, is_causal=causal)
        layer.backward(dout)

    for _ in range(20):
        step()
    return _median_ms(step)


def _gpt_timing(config, rounds):
    import qkvnp
    from qkvnp.losses import cross_entropy_backward, cross_entropy_forward
    from qkvnp.optim import AdamW

    V, C, E, H, layers, B = config
    rng = np.random.default_rng(0)
    model = qkvnp.GPTModel(V, C, E, H, layers, rng=0, dtype=np.float32)
    optimizer = AdamW(model.params, lr=4e-4, weight_decay=0.1)
    inputs, targets = rng.integers(0, V, (B, C)), rng.integers(0, V, (B, C))

    def step():
        model.zero_grad()
        loss, cache = cross_entropy_forward(model.forward(inputs), targets)
        model.backward(cross_entropy_backward(1.0, cache))
        optimizer.step(model.grads)

    for _ in range(3):
        step()
    return _median_ms(step, rounds=rounds, seconds=0.3)


def measure(layer_configs=LAYER_CONFIGS, gpt_configs=GPT_CONFIGS, rounds=7):
    """``{timing name: milliseconds}`` in the checkout this process imports qkvnp from."""
    timings = {}
    for config in layer_configs:
        for causal in (False, True):
            name = f"layer {config} {'causal' if causal else 'none'}"
            timings[name] = _layer_timing(config, causal)
    for name, config in gpt_configs.items():
        timings[f"gpt step {name}"] = _gpt_timing(config, rounds)
    return timings


def compare(old_runs, new_runs):
    """Lines of ``name, old median, new median, ratio`` and the median ratio."""
    lines, ratios = [], []
    for name in old_runs[0]:
        old = statistics.median(run[name] for run in old_runs)
        new = statistics.median(run[name] for run in new_runs)
        ratios.append(new / old)
        lines.append(f"{name:32s} {old:9.3f} ms {new:9.3f} ms  new/old {new / old:.3f}")
    lines.append(f"median of the ratios: {statistics.median(ratios):.3f} "
                 f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    return lines


def _load(paths):
    runs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            runs.append(json.load(f))
    return runs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the timings here")
    parser.add_argument("--compare", nargs="+", metavar="JSON",
                        help="old runs, then '--', then new runs: compare them")
    args, rest = parser.parse_known_args(argv)
    if args.compare:
        new = [arg for arg in rest if arg != "--"]
        if not new:
            parser.error("--compare needs the old runs, '--', then the new runs")
        print("\n".join(compare(_load(args.compare), _load(new))))
        return 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import qkvnp
    from qkvnp.kernels import blas_threads, num_threads

    with blas_threads(1), num_threads(1):
        timings = measure()
    print(f"qkvnp from {os.path.dirname(qkvnp.__file__)}")
    for name, ms in timings.items():
        print(f"{name:32s} {ms:9.3f} ms")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(timings, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
