"""A Qwen3-like decoder, qkvnp against transformers: ``python benchmarks/families_bench.py [--threads 1 2] [--json out.json]``.

Shape key: B batch, T tokens, V vocabulary, E embedding, L layers, H query
heads, K key/value heads, D head dim, F the MLP's width.

The configuration (:data:`workloads.families.QWEN3`): L 4, E 256, H 4, K 2,
D 64, V 4096, F 768, untied head, float32; qkvnp's
:class:`~qkvnp.models.decoder.Decoder` loads transformers'
``Qwen3ForCausalLM``'s weights (:func:`qkvnp.interop.from_hf`). At each
thread count (both libraries at the same: qkvnp's BLAS and pool, torch's
``set_num_threads``), each library in a process of its own, asked in turn
for one round each (the protocol of ``harness/workers.py``), warm-up rounds
first, medians of ``--repeats`` rounds:

- **decode**: greedy tokens per second at batch 1, a prompt of 16 tokens and
  64 new ones with KV caches (:func:`qkvnp.generate` against
  ``generate(do_sample=False)``), target at least 1.5x transformers'. The
  tokens must be the same first;
- **train**: AdamW steps per second at B 8, T 128 (zero, forward,
  cross-entropy, backward, step), target at least 1.0x. The first losses
  must agree (relative 1e-4, float32) first. Beside it, the ceiling: in
  each library's worker, rounds of a step followed by its parts alone
  (:func:`workloads.families.time_parts`, the medians): the step's matrix
  products alone on random arrays
  (:func:`workloads.families.step_products`, numpy's as qkvnp's step runs
  them, each worker thread its share of the batch, against torch's) and
  its attention cores alone (qkvnp's against torch's fused
  ``scaled_dot_product_attention``, :func:`workloads.families.time_core`),
  the rest of each step, and the ratio qkvnp would reach with torch's
  products and cores in place of its own (parts timed apart from the
  step; at more than one thread qkvnp's cores alone split over its pool,
  not in the batch shares: ``train_ceiling.py`` measures that ceiling in
  place, in qkvnp's own step). At more than one thread, what
  qkvnp's split of the batch over its threads costs a step
  (:func:`workloads.families.time_split`): the time its threads wait for
  the slowest share, and the time that share spent off its CPU.

``--profile`` adds a cProfile of qkvnp's call of each task. Without
transformers, qkvnp's side is measured and the ratios are left blank.
"""
import argparse
import json
import os
import sys
import tempfile

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, CHECKOUT)  # this checkout's benchmarks package and qkvnp, installed or not

import numpy as np  # noqa: E402

from benchmarks.harness.machine import CHILD_PATH, environment_info  # noqa: E402
from benchmarks.harness.workers import Worker, WorkerError, time_alternating  # noqa: E402
from benchmarks.workloads.families import NEW_TOKENS, QWEN3, TINY  # noqa: E402
from qkvnp._io import atomic_write  # noqa: E402

__all__ = ["TARGETS", "LOSS_TOLERANCE", "CHECK_CALLS", "check_outputs", "run_task", "run",
           "format_report", "main"]

#: qkvnp / transformers, at least.
TARGETS = {"decode": 1.5, "train": 1.0}
LOSS_TOLERANCE = 1e-4  # float32 losses of the first steps, relative
PART_ROUNDS = 9  # rounds of a step and its parts alone (the ceiling lines)
CHECK_CALLS = 3


def _stats(seconds, per_call):
    ms = 1e3 * np.asarray(seconds)
    median = float(np.median(ms))
    return {"ms": median, "times_ms": [float(t) for t in ms], "per_s": per_call * 1e3 / median}


def check_outputs(task, outputs):
    """Whether the libraries' tokens (decode) or first losses (train) agree, and by how much."""
    mine, theirs = outputs["qkvnp"], outputs["torch"]
    if task == "decode":
        return float(mine != theirs), mine == theirs
    mine, theirs = np.asarray(mine), np.asarray(theirs)
    error = float(np.max(np.abs(mine - theirs) / np.abs(theirs)))
    return error, error <= LOSS_TOLERANCE


def run_task(task, threads, args, directory):
    """Check, then time ``task`` at ``threads``: the record of one table row."""
    config = TINY if args.tiny else QWEN3
    weights = os.path.join(directory, f"weights-{task}-{threads}.npz")
    workers, record = {}, {"task": task, "threads": threads}
    try:
        for library in ("torch", "qkvnp"):  # torch first: it writes the weights
            worker = Worker(library, CHILD_PATH, module="benchmarks.workloads.families")
            reply = worker.request("setup", spec={"library": library, "task": task,
                                                  "config": config, "threads": threads,
                                                  "weights": weights if "torch" in workers
                                                  or library == "torch" else None})
            if "missing" in reply:
                record["missing"] = reply["missing"]
                worker.close()
                continue
            workers[library] = worker
        outputs = {name: w.request("outputs", calls=CHECK_CALLS if task == "train" else 1)
                   ["outputs"] for name, w in workers.items()}
        if "torch" in workers:
            record["check_error"], record["agree"] = check_outputs(task, outputs)
            if not record["agree"]:
                return record
        seconds, calls = time_alternating(workers, "fwd", args.repeats, args.warmup, args.pause,
                                          args.round_time)
        per_call = NEW_TOKENS if task == "decode" else 1
        for name in workers:
            record[name] = dict(_stats(seconds[name], per_call), calls_per_round=calls[name])
        if "torch" in workers:
            record["ratio"] = record["qkvnp"]["per_s"] / record["torch"]["per_s"]
            record["target"] = TARGETS[task]
        if task == "train":  # the ceilings: each library's products and attention cores alone
            for name, worker in workers.items():
                parts = worker.request("parts", rounds=PART_ROUNDS)
                record[name].update({f"{part}_ms": 1e3 * parts[part] for part in
                                     ("step", "products", "core", "rest")})
            if "torch" in workers:
                record["ceiling_ratio"] = _ceiling_ratio(record["qkvnp"], record["torch"])
            if threads > 1:  # what qkvnp's split of the batch over its threads costs
                split = workers["qkvnp"].request("split", rounds=PART_ROUNDS)
                record["qkvnp"].update({"split_shares": split["shares"],
                                        "imbalance_ms": 1e3 * split["imbalance"],
                                        "off_cpu_ms": 1e3 * split["off_cpu"]})
        if args.profile:
            record["profile"] = workers["qkvnp"].request("profile", calls=2)
    finally:
        for worker in workers.values():
            worker.close()
    return record


def _ceiling_ratio(mine, theirs):
    """The ratio qkvnp's step would reach with torch's products and attention cores:
    torch's step over qkvnp's, less what its products and cores take beyond torch's
    (the steps and parts of :func:`workloads.families.time_parts`, interleaved)."""
    held = (mine["step_ms"] - (mine["products_ms"] - theirs["products_ms"])
            - (mine["core_ms"] - theirs["core_ms"]))
    return theirs["step_ms"] / held


def run(args, progress=None):
    """Every task at every thread count; the report (a JSON-ready dict)."""
    report = {"environment": environment_info(torch=False),
              "config": TINY if args.tiny else QWEN3, "rows": []}
    with tempfile.TemporaryDirectory() as directory:
        for threads in args.threads:
            for task in args.tasks:
                if progress:
                    progress(f"{task} at {threads} thread(s)")
                report["rows"].append(run_task(task, threads, args, directory))
    return report


def format_report(report):
    """The printed report: host, configuration, one line per task and thread count."""
    env = report["environment"]
    lines = [f"host: {env.get('cpu', '?')}, {env.get('cores', '?')} cores; numpy "
             f"{env.get('numpy', '?')}, torch {env.get('torch', '?')}; load "
             f"{[round(x, 2) for x in env.get('load_average') or []]}",
             "config: " + ", ".join(f"{k}={v}" for k, v in report["config"].items()),
             f"{'task':<7} {'thr':>3} {'qkvnp/s':>9} {'torch/s':>9} {'ratio':>6} {'target':>6}"
             f"  rounds (ms, qkvnp | torch)"]
    for row in report["rows"]:
        unit = "tok" if row["task"] == "decode" else "step"
        if "agree" in row and not row["agree"]:
            lines.append(f"{row['task']:<7} {row['threads']:>3} REFUSED: the libraries disagree "
                         f"({row['check_error']:.3g})")
            continue
        mine, theirs = row["qkvnp"], row.get("torch")
        ratio = f"{row['ratio']:.2f}x" if "ratio" in row else "-"
        verdict = "" if "ratio" not in row else (" ok" if row["ratio"] >= row["target"]
                                                 else " MISSED")
        lines.append(f"{row['task']:<7} {row['threads']:>3} {mine['per_s']:>9.2f} "
                     f"{theirs['per_s'] if theirs else float('nan'):>9.2f} {ratio:>6} "
                     f"{TARGETS[row['task']]:>5}x{verdict}  {unit}/s; "
                     + " ".join(f"{t:.1f}" for t in mine["times_ms"]) + " | "
                     + (" ".join(f"{t:.1f}" for t in theirs["times_ms"]) if theirs else "-"))
        if "products_ms" in mine:
            lines += _ceiling_lines(mine, theirs, row.get("ceiling_ratio"))
        if mine.get("split_shares", 1) > 1:
            lines.append(f"        qkvnp's batch split in {mine['split_shares']} shares, a step: "
                         f"{mine['imbalance_ms']:.1f} ms waiting for the slowest share, which "
                         f"spent {mine['off_cpu_ms']:.1f} ms off its CPU (the GIL, the host)")
        for name, share in row.get("profile", {}).get("top", []):
            lines.append(f"        {100 * share:5.1f}%  {name}")
    missing = {row["missing"] for row in report["rows"] if "missing" in row}
    lines += [f"transformers' side skipped: {text}" for text in missing]
    return "\n".join(lines)


def _ceiling_lines(mine, theirs, ceiling):
    """The step's products and attention cores alone in each library, the rest, the ceiling."""
    if theirs is None or "products_ms" not in theirs:
        return [f"        products alone {mine['products_ms']:.1f} ms, attention cores alone "
                f"{mine['core_ms']:.1f} ms (numpy, same threads)"]
    rest = {name: side["rest_ms"] for name, side in (("qkvnp", mine), ("torch", theirs))}
    return [f"        interleaved with steps of {mine['step_ms']:.1f} ms (qkvnp) and "
            f"{theirs['step_ms']:.1f} (torch):",
            f"        products alone: numpy {mine['products_ms']:.1f} ms, torch "
            f"{theirs['products_ms']:.1f} ({mine['products_ms'] / theirs['products_ms']:.2f}x); "
            f"attention cores alone: qkvnp {mine['core_ms']:.1f} ms, torch's fused "
            f"{theirs['core_ms']:.1f}",
            f"        the rest of the step: qkvnp {rest['qkvnp']:.1f} ms, torch "
            f"{rest['torch']:.1f}; with torch's products and cores: {ceiling:.2f}x (the ceiling)"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tasks", nargs="+", choices=("decode", "train"),
                        default=["decode", "train"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--pause", type=float, default=0.3)
    parser.add_argument("--round-time", type=float, default=0.25)
    parser.add_argument("--profile", action="store_true", help="cProfile qkvnp's call")
    parser.add_argument("--tiny", action="store_true", help="a tiny config (the tests')")
    parser.add_argument("--json", help="write every number here")
    args = parser.parse_args(argv)
    try:
        report = run(args, progress=lambda text: print(text, file=sys.stderr, flush=True))
    except WorkerError as error:
        print(f"families_bench: {error}", file=sys.stderr)
        return 1
    print(format_report(report))
    if args.json:
        with atomic_write(args.json, "w") as out:
            json.dump(report, out, indent=1)
    return 1 if any(row.get("agree") is False for row in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
