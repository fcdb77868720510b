"""The attention variants' targets: a sliding window on the tiled path, a bounded decoder, option costs.

usage: python benchmarks/variants_bench.py [--quick] [--tokens N]

Three measurements, each printing the ratio it is judged by:

1. ``(1, L, 64, 1)`` float32 with ``window=(255, 0)`` on the tiled path
   against the full causal tiled path at the same shape: fwd+bwd time (median
   of repeats after a warm-up) and peak traced memory (``tracemalloc``).
   Target: at most 1/8 of the time at L = 16384, and no more memory.
2. Decoding ``--tokens`` tokens one by one with ``window=(255, 0)``: the
   cache's bytes after the first 256 tokens and at the end (target: equal).
3. ``(8, 128, 256, 8)`` float32, the default path, fwd+bwd of the layer
   with ``rope=True``, ``softcap=30`` or ``position_bias="alibi"`` against
   the plain layer (target: at most 1.3x).

Fixed seeds; the machine's load is not controlled: run it on an idle host.
"""
import argparse
import os
import sys
import time
import tracemalloc

import numpy as np

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, CHECKOUT)  # this checkout's benchmarks package and qkvnp, installed or not

import qkvnp  # noqa: E402
from qkvnp.kernels import tiled, tiled_variants  # noqa: E402


def median_time(step, repeats, warmup=1):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def peak_mib(step):
    tracemalloc.start()
    try:
        step()
        return tracemalloc.get_traced_memory()[1] / 2 ** 20
    finally:
        tracemalloc.stop()


def window_against_causal(L, repeats):
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, L, 64)).astype(np.float32) for _ in range(4))

    def full():
        _, cache = tiled.attention_forward(q, k, v, is_causal=True)
        tiled.attention_backward(dout, cache)

    def window():
        _, cache = tiled_variants.attention_forward(q, k, v, is_causal=True, window=(255, 0))
        tiled_variants.attention_backward(dout, cache)

    with qkvnp.kernels.single_threaded_blas():
        times = [median_time(f, repeats) for f in (full, window)]
    peaks = [peak_mib(f) for f in (full, window)]
    print(f"1. (1, {L}, 64, 1) float32 fwd+bwd: full causal tiled {times[0]:.3f} s, "
          f"{peaks[0]:.1f} MiB; window (255, 0) {times[1]:.3f} s, {peaks[1]:.1f} MiB")
    print(f"   time ratio {times[1] / times[0]:.3f} (target <= 0.125), memory ratio "
          f"{peaks[1] / peaks[0]:.3f} (target <= 1)")


def bounded_decoder(tokens):
    layer = qkvnp.MultiHeadAttention(64, 4, rng=0, rope=True, window=(255, 0))
    x = np.random.default_rng(1).standard_normal((1, tokens, 64))
    cache = qkvnp.KVCache()
    start = time.perf_counter()
    after_256 = None
    for t in range(tokens):
        layer.forward(x[:, t:t + 1], kv_cache=cache)
        if t == 255:
            after_256 = cache.nbytes
    elapsed = time.perf_counter() - start
    print(f"2. decoded {tokens} tokens in {elapsed:.1f} s: cache {after_256} bytes after 256 "
          f"tokens, {cache.nbytes} at the end, {len(cache)} keys held "
          f"({'constant' if after_256 == cache.nbytes else 'GREW'})")


def option_costs(repeats):
    B, T, E, H = 8, 128, 256, 8
    rng = np.random.default_rng(2)
    x = rng.standard_normal((B, T, E)).astype(np.float32)
    dout = rng.standard_normal((B, T, E)).astype(np.float32)

    def cost(**options):
        layer = qkvnp.MultiHeadAttention(E, H, rng=0, dtype=np.float32, **options)

        def step():
            layer.forward(x, is_causal=True)
            layer.backward(dout)
        return median_time(step, repeats, warmup=3), layer.last_dispatch.path

    plain, _ = cost()
    print(f"3. ({B}, {T}, {E}, {H}) float32 fwd+bwd: plain {plain * 1e3:.1f} ms")
    for options in ({"rope": True}, {"softcap": 30.0}, {"position_bias": "alibi"}):
        seconds, path = cost(**options)
        print(f"   {options}: {seconds * 1e3:.1f} ms on {path}, {seconds / plain:.2f}x "
              "(target <= 1.3)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L = 4096, 3 repeats, 2000 tokens")
    parser.add_argument("--tokens", type=int, default=None, help="tokens to decode (100000)")
    args = parser.parse_args(argv)
    L, repeats = (4096, 3) if args.quick else (16384, 5)
    tokens = args.tokens or (2000 if args.quick else 100_000)
    window_against_causal(L, repeats)
    bounded_decoder(tokens)
    option_costs(5 if args.quick else 21)
    return 0


if __name__ == "__main__":
    sys.exit(main())
