"""The book's GPT, qkvnp against PyTorch: ``python benchmarks/gpt_compare.py [--json out.json]``.

Shape key: V vocabulary, C context length, E embedding, H heads, L layers,
B batch, T tokens of a training window (:class:`workloads.gpt.GPTConfig`,
written ``(V, C, E, H, L, B, T)``; six numbers mean T = C).

Measures the GPT's speed and memory targets on this host, each library in a process
of its own (the harness's protocol of ``harness/workers.py``: the parent asks the
two workers in turn for one timed round each, qkvnp, PyTorch, qkvnp, ...,
pausing between them, the first of a round rotating; a round is as many
calls as last at least ``--round-time`` seconds; reported is the median
over the rounds of the time per call):

- **training**: steps per second of one AdamW step of :class:`qkvnp.GPTModel`
  against the book's ``GPTModel`` written in torch (:mod:`rivals.gpt_torch`),
  float32, dropout 0, PyTorch at 2 threads, qkvnp with its default threads,
  at ``tiny`` (256, 64, 64, 4, 2, 8), target 1.5x PyTorch's, and ``small``
  (256, 128, 128, 4, 4, 8), target 1.0x (the default configurations); and, on
  request, ``gpt2`` (50257, 1024, 768, 12, 12, 4, 64), the book's
  ``GPT_CONFIG_124M`` (untied head, 163M parameters) on batches of 4 x 64
  tokens, target 1.0x. The losses of the first steps from the same weights
  must agree first (relative 1e-5), or nothing is timed;
- **the matrix products** of the step (:func:`workloads.gpt.step_products`) on
  random arrays of the same shapes, timed in qkvnp's worker: their share of
  qkvnp's step, and the speedup qkvnp would have over PyTorch if nothing but
  them cost time. Where that is below a missed target, the BLAS holds the
  target. A missed target also gets a cProfile of qkvnp's step;
- **peak memory of a step**: fresh processes, peak RSS (the method of the
  harness's ``harness/memory.py``; :func:`workloads.gpt.memory_child`), target at most
  1.25x PyTorch's;
- **generation**: greedy tokens per second at batch 1 of
  :func:`qkvnp.generate` (its KV cache) against the book's model decoding
  with a KV cache (:func:`rivals.gpt_torch.generate_cached`), small configuration,
  target 1.0x. Both must produce the same tokens first.

Without PyTorch, qkvnp's side is still measured and the ratios are left
blank. Results belong in ``RESULTS.md``, dated.

The 124M step at one thread each, then at two (qkvnp's default threads,
PyTorch's 2); a step takes seconds, so a run takes minutes::

    python benchmarks/gpt_compare.py --configs gpt2 --no-generation --threads 1 --torch-threads 1
    python benchmarks/gpt_compare.py --configs gpt2 --no-generation

Each configuration's weights and batches are written once to a temporary
``.npz`` file (650 MB at ``gpt2``), read by both workers, then removed.
"""
import argparse
import json
import os
import sys
import tempfile
import time

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, CHECKOUT)  # this checkout's benchmarks package and qkvnp, installed or not

import numpy as np  # noqa: E402

from benchmarks.harness.machine import CHILD_PATH, environment_info, run_json_child  # noqa: E402
from benchmarks.harness.workers import Worker, WorkerError, time_alternating  # noqa: E402
from benchmarks.workloads.gpt import (  # noqa: E402
    CHECK_STEPS, CONFIGS, LOSS_TOLERANCE, TORCH_THREADS, GPTConfig, make_data, products_flops,
    step_products)
from qkvnp._io import atomic_write  # noqa: E402  (the package's one atomic write)

__all__ = ["TARGETS", "check_losses", "run_training", "run_generation",
           "measure_step_memory", "run", "format_report", "main"]

#: qkvnp / PyTorch: at least (speed), at most (memory).
TARGETS = {"train/tiny": 1.5, "train/small": 1.0, "train/gpt2": 1.0, "memory": 1.25,
           "generate": 1.0}


def check_losses(losses, expected):
    """Largest relative difference of two loss sequences, and whether it is within tolerance.

    >>> check_losses([2.0, 1.0], [2.0, 1.5])
    (0.3333333333333333, False)
    """
    losses, expected = np.asarray(losses, np.float64), np.asarray(expected, np.float64)
    if losses.shape != expected.shape or not np.isfinite(losses).all():
        return float("inf"), False
    error = float(np.max(np.abs(losses - expected) / np.abs(expected)))
    return error, error <= LOSS_TOLERANCE


def _stats(seconds, calls, per_call=1):
    ms = 1e3 * np.asarray(seconds)
    median = float(np.median(ms))
    return {"ms": median, "q1_ms": float(np.percentile(ms, 25)),
            "q3_ms": float(np.percentile(ms, 75)), "times_ms": [float(t) for t in ms],
            "calls_per_round": calls, "per_s": per_call * 1e3 / median}


def _shape(config):
    """``config`` as seven numbers, T written out."""
    return list(config._replace(tokens=config.seq_len))


def _products_floor(times, threads):
    """Seconds the step's products need at least, from the worker's ``products`` reply.

    NOTE: on two cores, numpy's threads on each product, or one thread each
    with the products split perfectly between the cores (qkvnp's pool runs
    one-thread BLAS calls side by side), whichever is faster; at ``threads``
    1, the products on one thread.
    """
    if threads == 1:
        return min(times["seconds"], times["one_thread_seconds"])
    return min(times["seconds"], times["one_thread_seconds"] / min(2, os.cpu_count()))


def _setup(workers, task, config, data_path, args, directory):
    """Set every worker up; return (workers that run, their results, why PyTorch is missing).

    ``data_path`` (:func:`workloads.gpt.make_data`'s ``.npz``) is removed once
    the workers have read it: each holds what it needs, and a big model's
    file need not stay on disk beside the next one's.
    """
    running, results, missing = {}, {}, None
    try:
        for library, worker in workers.items():
            reply = worker.request("setup", spec={"library": library, "task": task,
                                                  "config": list(config), "data": data_path,
                                                  "threads": args.threads,
                                                  "torch_threads": args.torch_threads})
            if "missing" in reply:
                missing = reply["missing"]
                continue
            path = os.path.join(directory, f"{library}-{task}.npz")
            worker.request("result", path=path)
            with np.load(path, allow_pickle=False) as stored:
                results[library] = dict(stored)
            running[library] = worker
    finally:
        os.remove(data_path)
    return running, results, missing


def _time(record, running, mode, args, per_call=1):
    seconds, calls = time_alternating(running, mode, args.repeats, args.warmup, args.pause,
                                      args.round_time)
    for library in running:
        record[library] = _stats(seconds[library], calls[library], per_call)
    if "torch" in running and "qkvnp" in running:
        record["ratio"] = record["qkvnp"]["per_s"] / record["torch"]["per_s"]
        if record["target"] is not None:  # the named configurations have one
            record["met"] = record["ratio"] >= record["target"]


def run_training(name, config, workers, args, directory):
    """Check, then time, one configuration's training step; add the products' share.

    Returns
    -------
    dict
        ``workload`` "train", ``config`` (name), ``shape``, ``status`` ("ok",
        "refused", "error"), ``reason``, ``check`` (``losses`` of both,
        ``max_rel_err``, ``tolerance``), ``qkvnp``/``torch`` (``ms`` per
        step: median, quartiles, every round's; ``per_s`` steps per second),
        ``ratio`` (qkvnp's steps/s / PyTorch's), ``target``, ``met``,
        ``products`` and, for a missed target, ``profile``.
    """
    record = {"workload": "train", "config": name, "shape": _shape(config), "status": "ok",
              "reason": None, "check": None, "qkvnp": None, "torch": None, "ratio": None,
              "target": TARGETS.get(f"train/{name}"), "met": None, "products": None}
    data_path = os.path.join(directory, f"data-{name}.npz")
    np.savez(data_path, **make_data(config))
    try:
        running, results, missing = _setup(workers, "train", config, data_path, args, directory)
        record["reason"] = missing
        if "torch" in results:
            error, ok = check_losses(results["qkvnp"]["loss"], results["torch"]["loss"])
            record["check"] = {"max_rel_err": error if np.isfinite(error) else None,
                               "tolerance": LOSS_TOLERANCE,
                               "losses": {lib: [float(x) for x in r["loss"]]
                                          for lib, r in results.items()}}
            if not ok:
                record["status"] = "refused"
                record["reason"] = (f"the losses of the first {CHECK_STEPS} steps disagree: "
                                    f"relative difference {error:.3g} > {LOSS_TOLERANCE:g}")
                return record
        _time(record, running, "fwd_bwd", args)
        products = step_products(config)
        flops = products_flops(products)
        times = running["qkvnp"].request("products", repeats=args.repeats)
        seconds = _products_floor(times, args.threads)
        step = record["qkvnp"]["ms"] / 1e3
        record["products"] = {"count": sum(c for c, *_ in products), "calls": len(products),
                              "flops": flops, "ms": 1e3 * times["seconds"],
                              "one_thread_ms": 1e3 * times["one_thread_seconds"],
                              "floor_ms": 1e3 * seconds, "gflops": flops / seconds / 1e9,
                              "share": seconds / step,
                              "handoff_us": 1e6 * times["handoff_seconds"]}
        if record["torch"]:
            # NOTE: the speedup qkvnp would have if its step were its products alone
            record["products"]["floor_ratio"] = record["torch"]["ms"] / 1e3 / seconds
            if record["met"] is False and args.profile:
                record["profile"] = running["qkvnp"].request("profile", steps=3)
    except WorkerError as error:
        record["status"], record["reason"] = "error", str(error)
    return record


def run_generation(name, config, workers, args, directory):
    """Check, then time, greedy generation at batch 1: tokens per second of both libraries."""
    config = config._replace(batch=1)
    record = {"workload": "generate", "config": name, "shape": _shape(config), "status": "ok",
              "reason": None, "new_tokens": None, "same_tokens": None, "qkvnp": None,
              "torch": None, "ratio": None, "met": None,
              "target": TARGETS["generate"] if name == "small" else None}
    data_path = os.path.join(directory, f"data-{name}-generate.npz")
    data = make_data(config)
    np.savez(data_path, **data)
    new_tokens = config.context - data["prompt"].shape[1]
    record["new_tokens"] = new_tokens
    try:
        running, results, missing = _setup(workers, "generate", config, data_path, args,
                                                     directory)
        record["reason"] = missing
        if "torch" in results:
            ours, theirs = results["qkvnp"]["tokens"], results["torch"]["tokens"]
            same = ours.shape == theirs.shape and bool(np.array_equal(ours, theirs))
            record["same_tokens"] = same
            if not same:
                differ = np.flatnonzero(ours.ravel() != theirs.ravel()) if \
                    ours.shape == theirs.shape else [None]
                record["status"] = "refused"
                record["reason"] = (f"the generated tokens differ (first at index {differ[0]}; "
                                    f"shapes {ours.shape}, {theirs.shape})")
                return record
        _time(record, running, "fwd", args, per_call=new_tokens)
    except WorkerError as error:
        record["status"], record["reason"] = "error", str(error)
    return record


def measure_step_memory(library, config, threads=None, torch_threads=TORCH_THREADS,
                        timeout=600):
    """Peak memory of one training step in a fresh process (:func:`workloads.gpt.memory_child`).

    Returns
    -------
    dict
        ``step_mib``, ``peak_mib``, ``tracemalloc_mib``, ``method``; or
        ``error`` (the child's last line), or ``missing`` (no torch).
    """
    spec = json.dumps({"library": library, "config": list(config), "threads": threads,
                       "torch_threads": torch_threads})
    return run_json_child("benchmarks.workloads.gpt", "memory_child", spec, timeout)


def run(args, progress=None):
    """Every measurement ``args`` asks for; returns the report (a JSON-ready dict)."""
    progress = progress or (lambda message: None)
    report = {"environment": dict(environment_info(torch=False),
                                  torch_threads=args.torch_threads),
              "threads": "at 1 thread" if args.threads == 1 else "with its default threads",
              "train": [], "generate": [], "memory": []}
    workers = {name: Worker(name, CHILD_PATH, module="benchmarks.workloads.gpt")
               for name in ("qkvnp", "torch")}
    try:
        with tempfile.TemporaryDirectory(prefix="qkvnp-gpt-bench-") as directory:
            for name, config in args.configs:
                progress(f"training step, {name} {tuple(_shape(config))}")
                report["train"].append(run_training(name, config, workers, args, directory))
            if args.generate:
                name, config = args.generate
                progress(f"generation, {name} {tuple(_shape(config._replace(batch=1)))}")
                report["generate"].append(run_generation(name, config, workers, args,
                                                         directory))
    finally:
        for worker in workers.values():
            worker.close()
    if args.memory:
        for name, config in args.configs:
            progress(f"memory of a step, {name}")
            measured = {lib: measure_step_memory(lib, config, args.threads, args.torch_threads)
                        for lib in ("qkvnp", "torch")}
            record = {"config": name, "shape": _shape(config),
                      "target": TARGETS["memory"] if name in CONFIGS else None,
                      "ratio": None, "met": None, **measured}
            if all("peak_mib" in measured[lib] for lib in measured):
                record["ratio"] = measured["qkvnp"]["peak_mib"] / measured["torch"]["peak_mib"]
                if record["target"] is not None:
                    record["met"] = record["ratio"] <= record["target"]
            report["memory"].append(record)
    return report


# ---------------------------------------------------------------- report


def _threads(count):
    return f"{count} thread" + ("" if count == 1 else "s")


def _cell(stats, key="ms"):
    if not stats:
        return "-"
    return f"{stats[key]:.4g} [{stats['q1_' + key]:.3g}-{stats['q3_' + key]:.3g}]"


def _budget_lines(record):
    """What the missed target leaves on one core, and what a second core's hand-off costs."""
    products, torch = record["products"], record["torch"]
    if not torch:
        return []
    allowed = torch["ms"] / record["target"]  # the step the target asks for
    one = products["one_thread_ms"]
    rest = record["qkvnp"]["ms"] - one
    mean_call = 1e3 * one / products["calls"]
    return [f"    on one core the target's {allowed:.3g} ms step holds the products at one "
            f"thread ({one:.3g} ms) and {allowed - one:.3g} ms for the rest, which takes "
            f"{rest:.3g} ms now (step minus products)",
            f"    a second core: a hand-off to another thread and back costs "
            f"{products['handoff_us']:.3g} us here (threading.Event round trip), against "
            f"{mean_call:.3g} us per product call on one thread ({products['calls']} calls)"]


def _verdict(record, at_least=True):
    if record.get("ratio") is None:
        return "-"
    if record.get("target") is None:
        return f"{record['ratio']:.2f}x"
    sign = ">=" if at_least else "<="
    return f"{record['ratio']:.2f}x (target {sign} {record['target']}x: " + \
        ("met)" if record["met"] else "MISSED)")


def format_report(report):
    """The printed report: environment, then one block per measurement, then the verdicts."""
    env = report["environment"]
    lines = [f"GPT benchmark {env['date_utc']} UTC: qkvnp {env['qkvnp']} ({env['commit']}) "
             f"against the book's GPTModel in PyTorch {env['torch'] or '(not installed)'}",
             f"{env['cpu']}, {env['cores']} cores, load average {env['load_average']}; "
             f"float32, dropout 0; PyTorch at {_threads(env['torch_threads'])}, qkvnp "
             f"{report['threads']}; one library per process", ""]
    if report["train"]:
        lines.append("Training: one step (zero grads, forward, cross-entropy, backward, AdamW "
                     "lr 4e-4 wd 0.1, loss as a float); ms per step, median [quartiles]")
    for record in report["train"]:
        lines.append(f"  {record['config']} (V,C,E,H,L,B,T)={tuple(record['shape'])}: "
                     f"{record['status']}")
        if record["status"] != "ok" or record["reason"]:
            lines.append(f"    {record['reason']}")
        if record["check"]:
            error = record["check"]["max_rel_err"]
            lines.append(f"    first {CHECK_STEPS} losses agree to {error:.2g}"
                         f" relative (tolerance {record['check']['tolerance']:g})")
        if record["qkvnp"]:
            lines.append(f"    qkvnp {_cell(record['qkvnp'])} ms ({record['qkvnp']['per_s']:.1f}"
                         " steps/s)" + (f"; PyTorch {_cell(record['torch'])} ms "
                                        f"({record['torch']['per_s']:.1f} steps/s)"
                                        if record["torch"] else ""))
            lines.append(f"    qkvnp / PyTorch steps per second: {_verdict(record)}")
        products = record.get("products")
        if products:
            line = (f"    its matrix products ({products['calls']} calls, {products['count']} "
                    f"2-D products, {products['flops'] / 1e9:.3g} GFLOP) on random arrays: "
                    f"{products['ms']:.3g} ms with the step's BLAS threads, "
                    f"{products['one_thread_ms']:.3g} on one; floor {products['floor_ms']:.3g} "
                    f"ms ({products['gflops']:.3g} GFLOP/s), {100 * products['share']:.0f}% of "
                    "qkvnp's step")
            if "floor_ratio" in products:
                line += (f"; qkvnp would be {products['floor_ratio']:.2f}x PyTorch if they "
                         "were all its step cost")
            lines.append(line)
            if record["met"] is False:
                held = products.get("floor_ratio", np.inf) < record["target"]
                lines.append("    the target is " + ("held by the BLAS: the products alone "
                                                     "take longer than the target allows"
                                                     if held else
                                                     "not held by the BLAS: the rest of the "
                                                     "step costs the difference"))
                lines += _budget_lines(record)
        if record.get("profile"):
            lines.append(f"    cProfile of {record['profile']['steps']} qkvnp steps, own time "
                         "(it includes the `@` products a function issues: cProfile sees no "
                         "operators):")
        for name, share in (record.get("profile") or {}).get("top", [])[:8]:
            lines.append(f"      {100 * share:5.1f}%  {name}")
    if report["memory"]:
        lines += ["", "Peak memory of a step (fresh process each: peak RSS during a step "
                  "minus RSS before the model was built; MiB)"]
    for record in report["memory"]:
        cells = []
        for lib in ("qkvnp", "torch"):
            m = record[lib]
            cells.append(f"{lib} " + (f"{m['peak_mib']:.1f} (step alone {m['step_mib']:.1f})"
                                      if "peak_mib" in m else
                                      m.get("missing") or m.get("error", "?")))
        lines.append(f"  {record['config']}: {'; '.join(cells)}; qkvnp / PyTorch: "
                     f"{_verdict(record, at_least=False)}")
    for record in report["generate"]:
        lines += ["", f"Generation: batch 1, {record['config']} (V,C,E,H,L)="
                  f"{tuple(record['shape'][:5])}, greedy, KV cache, {record['new_tokens']} new "
                  f"tokens after a prompt of {record['shape'][1] - record['new_tokens']}; ms per "
                  f"generation: {record['status']}"]
        if record["reason"]:
            lines.append(f"    {record['reason']}")
        if record["same_tokens"] is not None:
            lines.append(f"    same tokens in both: {'yes' if record['same_tokens'] else 'NO'}")
        if record["qkvnp"]:
            lines.append(f"    qkvnp {_cell(record['qkvnp'])} ms ({record['qkvnp']['per_s']:.0f}"
                         " tokens/s)" + (f"; PyTorch {_cell(record['torch'])} ms "
                                         f"({record['torch']['per_s']:.0f} tokens/s)"
                                         if record["torch"] else ""))
            lines.append(f"    qkvnp / PyTorch tokens per second: {_verdict(record)}")
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def _config(text):
    """``(text, GPTConfig)`` of a configuration's name or of V,C,E,H,L,B[,T]."""
    if text in CONFIGS:
        return text, CONFIGS[text]
    try:
        values = [int(v) for v in text.split(",")]
        if len(values) not in (6, 7):
            raise ValueError
        config = GPTConfig(*values)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected one of {sorted(CONFIGS)} or V,C,E,H,L,B[,T] (six or seven integers), "
            f"got {text!r}") from None
    if min(values) < 1 or config.width % config.heads:
        raise argparse.ArgumentTypeError(f"expected positive sizes with E divisible by H, got "
                                         f"{text!r}")
    if config.seq_len > config.context:
        raise argparse.ArgumentTypeError(f"expected T at most the context C, got {text!r}")
    return text, config


def _at_least(minimum, kind=int):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected at least {minimum}, got {text!r}")
        return value
    return parse


def main(argv=None):
    """The command line; returns the exit status (1 when a check refused a measurement)."""
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpt_compare.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", type=_config,
                        default=[("tiny", CONFIGS["tiny"]), ("small", CONFIGS["small"])],
                        metavar="NAME|V,C,E,H,L,B[,T]", help="training configurations: "
                        f"{', '.join(CONFIGS)} or sizes (default: tiny small)")
    parser.add_argument("--generate", type=_config, default=("small", CONFIGS["small"]),
                        metavar="NAME|V,C,E,H,L,B[,T]", help="generation configuration, batch 1 "
                        "(default: small)")
    parser.add_argument("--no-generation", dest="generate", action="store_const", const=None)
    parser.add_argument("--no-memory", dest="memory", action="store_false")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="no cProfile of qkvnp's step when a training target is missed")
    parser.add_argument("--threads", type=int, choices=(1,), default=None,
                        help="qkvnp at one thread (BLAS and its pool), as "
                        "`python -m qkvnp train --task text` runs; default its own. With "
                        "--torch-threads 1: the one-thread comparison")
    parser.add_argument("--torch-threads", type=_at_least(1), default=TORCH_THREADS,
                        help=f"PyTorch's threads ({TORCH_THREADS}, the targets', beside qkvnp's "
                        "default threads)")
    parser.add_argument("--repeats", type=_at_least(1), default=7, help="timed rounds (7)")
    parser.add_argument("--warmup", type=_at_least(0), default=1, help="untimed rounds (1)")
    parser.add_argument("--pause", type=_at_least(0.0, float), default=0.3,
                        help="seconds before a round that follows the other library's (0.3)")
    parser.add_argument("--round-time", type=_at_least(0.0, float), default=0.25,
                        help="shortest round, seconds (0.25)")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON, atomically")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    report = run(args, progress=lambda message: print(message, file=sys.stderr, flush=True))
    report["seconds"] = time.perf_counter() - start
    print(format_report(report))
    if args.json:
        with atomic_write(args.json, "w") as stream:
            json.dump(report, stream, indent=1)
    refused = [r for r in report["train"] + report["generate"] if r["status"] != "ok"]
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
