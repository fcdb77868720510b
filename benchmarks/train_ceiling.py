"""The decoder training step's ceiling: ``python benchmarks/train_ceiling.py [--threads 1 2] [--repeats 9]``.

The training task of ``families_bench.py`` (:mod:`workloads.families`: the
Qwen3-like ``Decoder``, batch 8 of 128 tokens, float32, cross-entropy and
AdamW) in five processes, asked in turn for one round each (the protocol
of ``harness/workers.py``), at each thread count:

- **transformers**: ``Qwen3ForCausalLM``'s step, torch at the same threads;
- **qkvnp**: its step as it is;
- **torch's mm, attention**: qkvnp's step, but every matrix product of the
  fused blocks and the head (``qkvnp/kernels/decoder_train.py``) is
  ``torch.matmul`` (MKL) and the attention core is torch's fused
  flash-attention kernel for the CPU, forward and backward, each called
  where qkvnp calls its own: in the same batch shares, on the same worker
  threads, torch at one thread in each (:mod:`workloads.torch_kernels`);
- **and torch's SiLU**: the same, and the gated activation ``silu(gate) *
  up`` and its backward are torch's fused SiLU kernels and products;
- **and no guarantees**: the same, without what qkvnp's guarantees cost
  (``workloads.torch_kernels.without_guarantees``, a measure, not a way to
  train): the weights not copied for the backward, no fresh zeros for the
  gradients (the commit puts each gradient in place, as torch's first
  accumulation does), the logits and ``dlogits`` not tested finite.

Everything else in the last three is qkvnp's: the norms, RoPE, the loss,
AdamW, the split of the batch. The first losses of the five must agree
(relative 1e-4, float32) before anything is timed. When a line with
torch's kernels runs at least as fast as transformers' step, what stands
between qkvnp and the 1.0x target is those kernels (numpy's BLAS, and
fused kernels numpy cannot express) and, on the last line, the cost of
the guarantees; when it is slower, the rest of qkvnp's step is too. A table
in ms a step (medians of the rounds) and each one's speed as a multiple of
transformers'. About 3.5 minutes.
"""
import argparse
import os
import sys
import tempfile

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, CHECKOUT)  # this checkout's benchmarks package and qkvnp, installed or not

import numpy as np  # noqa: E402

from benchmarks.families_bench import CHECK_CALLS, check_outputs  # noqa: E402
from benchmarks.harness.machine import CHILD_PATH, environment_info  # noqa: E402
from benchmarks.harness.workers import Worker, WorkerError, time_alternating  # noqa: E402
from benchmarks.workloads.families import QWEN3, TINY  # noqa: E402

__all__ = ["RUNNERS", "measure", "main"]

#: The runners: ``make_runner``'s library name, and the report's.
RUNNERS = {"torch": "transformers", "qkvnp": "qkvnp",
           "qkvnp+torch-mm-sdpa": "  torch's mm, attention",
           "qkvnp+torch-mm-sdpa-silu": "  and torch's SiLU",
           "qkvnp+torch-mm-sdpa-silu-unguarded": "  and no guarantees"}


def measure(threads, args, directory):
    """``{runner: [seconds a step, one a round]}`` at ``threads``, after checking the first losses."""
    config = TINY if args.tiny else QWEN3
    weights = os.path.join(directory, f"weights-{threads}.npz")
    workers = {}
    try:
        for library in RUNNERS:  # torch first: it writes the weights
            worker = workers[library] = Worker(library, CHILD_PATH,
                                               module="benchmarks.workloads.families")
            reply = worker.request("setup", spec={"library": library, "task": "train",
                                                  "config": config, "threads": threads,
                                                  "weights": weights})
            if "missing" in reply:
                raise SystemExit(f"train_ceiling: {reply['missing']}")
        losses = {name: worker.request("outputs", calls=CHECK_CALLS)["outputs"]
                  for name, worker in workers.items()}
        for name, mine in losses.items():
            error, agree = check_outputs("train", {"qkvnp": mine, "torch": losses["torch"]})
            if not agree:
                raise SystemExit(f"train_ceiling: {RUNNERS[name]}'s first losses {mine} differ "
                                 f"from transformers' {losses['torch']} (relative {error:.1e})")
        seconds, _ = time_alternating(workers, "fwd", args.repeats, args.warmup, args.pause,
                                      args.round_time)
    finally:
        for worker in workers.values():
            worker.close()
    return seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--pause", type=float, default=0.3)
    parser.add_argument("--round-time", type=float, default=0.5)
    parser.add_argument("--tiny", action="store_true", help="a tiny config (the tests')")
    args = parser.parse_args(argv)
    info = environment_info()
    print(f"host: {info.get('cpu', '?')}, {info.get('cores', '?')} cores; numpy "
          f"{info.get('numpy')}, torch {info.get('torch')}; load "
          f"{[round(x, 2) for x in os.getloadavg()]}")
    print("threads  step                     ms a step (median, range)   speed / transformers'")
    try:
        with tempfile.TemporaryDirectory() as directory:
            for threads in args.threads:
                seconds = measure(threads, args, directory)
                ms = {name: 1e3 * np.asarray(times) for name, times in seconds.items()}
                theirs = float(np.median(ms["torch"]))
                for name, times in ms.items():
                    mine = float(np.median(times))
                    print(f"{threads:>7}  {RUNNERS[name]:<23}  {mine:7.1f} ({times.min():.1f}-"
                          f"{times.max():.1f})       {theirs / mine:.2f}x", flush=True)
    except WorkerError as error:
        print(f"train_ceiling: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
