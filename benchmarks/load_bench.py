"""Loading a Hugging Face directory: time and peak memory against reading its bytes.

Usage::

    python benchmarks/load_bench.py [--dir DIR] [--rounds 5] [--dtype float32]

DIR is a ``save_pretrained`` directory; without one, a 124M-parameter GPT-2
(``GPT2LMHeadModel(GPT2Config())``, random weights, no download) is made in a
temporary directory with transformers, or with :func:`qkvnp.interop.save_hf`
when transformers is absent. Each round runs in fresh processes, one thing a
process:

- ``load``: ``qkvnp.interop.from_hf(DIR, dtype=...)``; the process reports its
  time and its peak resident memory (``VmHWM`` of ``/proc/self/status``,
  ``ru_maxrss`` elsewhere), which must stay under ``1.25 x N x itemsize +
  64 MiB`` for N parameters;
- ``cat``: ``cat`` of the weights to ``/dev/null``, the page cache warm (one
  untimed read first): the time of reading the bytes;
- ``touch``: ``np.ones`` of the loaded model's bytes, the time a fresh process takes to
  get that much memory from the system: on a virtual machine whose host backs
  pages lazily, a floor under any load that makes its own arrays.

It prints the median of each, the ratio load / cat, and the peak against its cap.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _peak_bytes():
    """This process's peak resident memory, in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # macOS gives bytes, Linux KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _child(what, directory, dtype, touch_count=0):
    """Run one measurement in this (fresh) process; print its JSON."""
    sys.path.insert(0, CHECKOUT)
    import numpy as np

    from qkvnp.interop import from_hf

    base = _peak_bytes()
    start = time.perf_counter()
    if what == "load":
        model = from_hf(directory, dtype=np.dtype(dtype))
        count = sum(p.size for p in model.params.values())
    else:  # touch: as many bytes as the loaded model's, fresh
        count = touch_count
        np.ones(count, np.dtype(dtype))
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak": _peak_bytes(), "base": base,
                      "params": int(count)}))


def _run_child(what, directory, dtype, count=0):
    command = [sys.executable, os.path.abspath(__file__), "--child", what, "--dir", directory,
               "--dtype", dtype, "--count", str(count)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _cat_seconds(directory):
    files = [os.path.join(directory, name) for name in sorted(os.listdir(directory))
             if name.endswith(".safetensors")]
    start = time.perf_counter()
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def make_gpt2(directory, **sizes):
    """A GPT-2 directory (124M with no ``sizes``): transformers' own when installed."""
    try:
        import transformers
    except ImportError:
        transformers = None
    if transformers is not None:
        transformers.GPT2LMHeadModel(transformers.GPT2Config(**sizes)).save_pretrained(directory)
        return directory
    sys.path.insert(0, CHECKOUT)
    import numpy as np

    from qkvnp.interop import save_hf
    from qkvnp.models.decoder import Decoder, DecoderConfig

    names = {"n_embd": "emb_dim", "n_layer": "num_layers", "n_head": "num_heads",
             "n_positions": "context_length", "vocab_size": "vocab_size"}
    cfg = DecoderConfig.gpt2(**{names[key]: value for key, value in sizes.items()})
    save_hf(Decoder(cfg, rng=0, dtype=np.float32), directory)
    return directory


def measure(directory, rounds=5, dtype="float32"):
    """The medians of ``rounds`` fresh-process loads, cats and touches, and the peak."""
    _cat_seconds(directory)  # the page cache warm
    loads, cats, touches = [], [], []
    for _ in range(rounds):
        loads.append(_run_child("load", directory, dtype))
        cats.append(_cat_seconds(directory))
        touches.append(_run_child("touch", directory, dtype, loads[0]["params"])["seconds"])
    params = loads[0]["params"]
    itemsize = 8 if dtype == "float64" else 4
    return {"params": params, "load_s": statistics.median(r["seconds"] for r in loads),
            "cat_s": statistics.median(cats), "touch_s": statistics.median(touches),
            "peak_bytes": max(r["peak"] for r in loads),
            "base_bytes": max(r["base"] for r in loads),
            "cap_bytes": int(1.25 * params * itemsize + 64 * 2 ** 20)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="a save_pretrained directory (default: a GPT-2 124M made "
                                      "in a temporary directory)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--child", choices=["load", "touch"], help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.dir, args.dtype, args.count)
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.dir or make_gpt2(os.path.join(scratch, "gpt2-124m"))
        result = measure(directory, args.rounds, args.dtype)
    mib = 2 ** 20
    print(f"{result['params'] / 1e6:.1f}M parameters, {args.dtype}, median of {args.rounds}")
    print(f"load  {result['load_s']:.3f} s   cat {result['cat_s']:.3f} s   "
          f"load / cat {result['load_s'] / result['cat_s']:.1f}x")
    print(f"touch {result['touch_s']:.3f} s   (np.ones of the same bytes, fresh process)")
    print(f"peak RSS {result['peak_bytes'] / mib:.0f} MiB (before loading "
          f"{result['base_bytes'] / mib:.0f}), cap {result['cap_bytes'] / mib:.0f} MiB: "
          f"{'under' if result['peak_bytes'] < result['cap_bytes'] else 'OVER'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
