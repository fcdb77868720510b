"""Why Q, K and V? Train kv-recall with separate, tied and missing projections.

Shape key: P stored pairs, E model width (``dim``).

The seeds ask: "why do we need key, value and query; could I use only one of
them?". This command answers by experiment. The same
:class:`~qkvnp.training.models.KVRecallModel` is trained on the same ``kv-recall``
data with four projection variants:

``separate``  independent ``W_query``, ``W_key``, ``W_value`` (the standard layer)
``tied_qk``   one matrix for queries and keys (``Q = K``), its own ``W_value``
``no_value``  ``W_query`` and ``W_key``, but values are the tokens themselves
``shared``    one matrix for all three

for several seeds each and at several model widths (default 8 and 16, 3000
steps per run: about 2-3 minutes on 2 cores), and prints the held-out
accuracy (mean, spread, worst and best) per variant and width. Every run is
:func:`qkvnp.training.loop.train` with only ``variant``, ``dim`` and ``seed`` changed.

Examples
--------
>>> rows = run_ablation(variants=("separate", "shared"), seeds=1, dims=(4,), steps=2,
...                     base=dict(num_keys=8, num_values=8, num_pairs=4, eval_size=8))
>>> [(row["variant"], row["dim"], row["seed"]) for row in rows]
[('separate', 4, 0), ('shared', 4, 0)]
>>> table = summarize(rows)
>>> table[0]["runs"], sorted(table[0])[:3]
(1, ['accuracies', 'dim', 'max'])
"""
import sys
import time

import numpy as np

from .._checks import check_int

__all__ = ["run_ablation", "summarize", "format_table", "add_arguments", "run"]

# NOTE: measured defaults. At the train command's width (64) every variant
# reaches 100% held-out accuracy in 1000 steps, so the question is only
# interesting for narrow models; 3000 steps let them converge (at 1000 the
# table mixes capacity with learning speed).
DEFAULT_DIMS = (8, 16)
DEFAULT_STEPS = 3000


def run_ablation(variants=None, seeds=3, dims=DEFAULT_DIMS, steps=DEFAULT_STEPS, base=None,
                 callback=None):
    """Train every (width, variant, seed) and return one row per run.

    Parameters
    ----------
    variants : sequence of str, optional
        Default: all of :data:`qkvnp.training.models.VARIANTS`.
    seeds : int
        Seeds ``0 .. seeds-1`` per variant and width.
    dims : sequence of int
        Model widths ``E``.
    steps : int or None
        Steps per run (default 3000; None: the train command's default, 1000).
    base : dict, optional
        Other :class:`qkvnp.training.loop.TrainConfig` fields shared by every run.
    callback : callable, optional
        Called with each row as it completes.

    Returns
    -------
    list of dict
        ``variant, dim, seed, accuracy, loss, parameters, seconds``.
    """
    from .models import VARIANTS
    from .loop import TrainConfig, train

    variants = tuple(VARIANTS) if variants is None else tuple(variants)
    for variant in variants:
        if variant not in VARIANTS:
            raise ValueError(f"variants must be among {tuple(VARIANTS)}, got {variant!r}")
    seeds = check_int(seeds, "seeds", 1, expected="a positive int")
    base = dict(base or {})
    rows = []
    for dim in dims:
        for variant in variants:
            for seed in range(seeds):
                config = TrainConfig(**{**base, "task": "kv-recall", "variant": variant,
                                        "dim": int(dim), "seed": seed, "steps": steps})
                result = train(config)
                row = {"variant": variant, "dim": int(dim), "seed": seed,
                       "accuracy": result.heldout["accuracy"], "loss": result.heldout["loss"],
                       "parameters": result.model.num_parameters(), "seconds": result.seconds}
                rows.append(row)
                if callback is not None:
                    callback(row)
    return rows


def summarize(rows):
    """Group rows by (width, variant): accuracy mean, sample standard deviation, min, max.

    Returns
    -------
    list of dict
        ``dim, variant, runs, mean, std, min, max, parameters, accuracies``
        in the order the groups first appear. ``std`` is 0 for one run.
    """
    groups = {}
    for row in rows:
        groups.setdefault((row["dim"], row["variant"]), []).append(row)
    table = []
    for (dim, variant), group in groups.items():
        accuracies = np.array([row["accuracy"] for row in group])
        table.append({
            "dim": dim, "variant": variant, "runs": len(group),
            "mean": float(accuracies.mean()),
            "std": float(accuracies.std(ddof=1)) if len(group) > 1 else 0.0,
            "min": float(accuracies.min()), "max": float(accuracies.max()),
            "parameters": group[0]["parameters"], "accuracies": accuracies.tolist(),
        })
    return table


def format_table(table):
    """The summary as aligned text lines (accuracies in percent)."""
    lines = [f"{'width':>5}  {'variant':<9} {'params':>7}  {'runs':>4}  "
             f"{'held-out accuracy':>19}  {'worst':>6}  {'best':>6}"]
    previous_dim = None
    for entry in table:
        if previous_dim is not None and entry["dim"] != previous_dim:
            lines.append("")
        previous_dim = entry["dim"]
        lines.append(
            f"{entry['dim']:>5}  {entry['variant']:<9} {entry['parameters']:>7,}  "
            f"{entry['runs']:>4}  {100 * entry['mean']:>8.2f}% ± {100 * entry['std']:>5.2f}  "
            f"{100 * entry['min']:>5.1f}%  {100 * entry['max']:>5.1f}%"
        )
    return lines


def _int_list(text):
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        import argparse

        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive ints such as 8,16,64, got {text!r}")
    return values


def add_arguments(parser):
    """Add the ``ablation`` options to an ``argparse`` parser."""
    from .models import VARIANTS

    parser.add_argument("--seeds", type=int, default=3, metavar="N",
                        help="seeds per variant and width (default 3)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="N",
                        help=f"training steps per run (default {DEFAULT_STEPS})")
    parser.add_argument("--dims", type=_int_list, default=DEFAULT_DIMS, metavar="E,E,...",
                        help="model widths (default 8,16; at the train command's width 64 "
                             "every variant reaches 100%%)")
    parser.add_argument("--variants", type=lambda text: tuple(text.split(",")),
                        default=tuple(VARIANTS), metavar="V,V,...",
                        help="default: " + ",".join(VARIANTS))
    parser.add_argument("--num-pairs", type=int, default=None, help="pairs per sequence (default 16)")
    parser.add_argument("--num-keys", type=int, default=None, help="default 64")
    parser.add_argument("--num-values", type=int, default=None, help="default 64")
    parser.add_argument("--eval-size", type=int, default=None, help="held-out sequences (default 2000)")
    parser.add_argument("--quiet", action="store_true", help="print the table only")


def run(args):
    """Run ``python -m qkvnp ablation``; return the exit code."""
    from .models import VARIANTS

    if args.seeds < 1:
        print(f"error: --seeds must be >= 1, got {args.seeds}", file=sys.stderr)
        return 2
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        print(f"error: --variants: unknown {unknown}; choose among {','.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    base = {name: getattr(args, name) for name in ("num_pairs", "num_keys", "num_values",
                                                   "eval_size")
            if getattr(args, name) is not None}
    total = len(args.dims) * len(args.variants) * args.seeds
    done = []
    started = time.perf_counter()

    def report(row):
        done.append(row)
        if args.quiet:
            return
        elapsed = time.perf_counter() - started
        left = elapsed / len(done) * (total - len(done))
        print(f"[{len(done):>{len(str(total))}}/{total}] width {row['dim']:>3} "
              f"{row['variant']:<9} seed {row['seed']}: held-out {100 * row['accuracy']:6.2f}% "
              f"({row['seconds']:.1f}s, about {left:.0f}s left)", file=sys.stderr, flush=True)

    try:
        rows = run_ablation(args.variants, args.seeds, args.dims, args.steps, base, report)
    except (TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"kv-recall ablation: {args.steps} steps per run, seeds 0..{args.seeds - 1}, "
          f"{time.perf_counter() - started:.0f}s in total")
    for line in format_table(summarize(rows)):
        print(line)
    print("held-out accuracy: mean ± sample standard deviation over seeds; "
          f"chance is {100 / (args.num_values or 64):.1f}%")
    return 0
