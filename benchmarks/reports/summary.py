"""What a benchmark run means for a user: plain sentences, the ratio table, the ratio plot.

Shape key: B batch, L sequence length, E embedding, H heads.

Everything here reads the report that ``bench.run_benchmark`` returns (or
its JSON file) and compares qkvnp's default path (``impl="auto"``, what
``MultiHeadAttention`` runs unless told otherwise) with PyTorch's
``nn.MultiheadAttention`` on forward+backward. A ratio is qkvnp's median
time / PyTorch's median time, measured in the same run: below 1, qkvnp is
faster.

>>> speed_phrase(0.5)
'2.0x faster than PyTorch'
>>> speed_phrase(1.34)
'1.3x slower than PyTorch'
"""
import math
import os
import sys

__all__ = ["SMALL_WORK", "speed_phrase", "default_path_ratios", "peak_memory", "summarize",
           "ratio_table", "plot_ratios"]

#: Shapes with B*L*E up to this are "small": per-call overhead, not
#: arithmetic, sets their time.
SMALL_WORK = 16_384
MEDIUM_MAX_LENGTH = 128


def speed_phrase(ratio, than=" than PyTorch"):
    """``ratio`` (qkvnp's time / PyTorch's) in words: "2.1x faster than PyTorch"."""
    if abs(math.log(ratio)) < math.log(1.02):
        return "about as fast" + (" as PyTorch" if than else "")
    factor = 1.0 / ratio if ratio < 1 else ratio
    text = format(factor, ".2f" if factor < 1.1 else ".1f")
    return f"{text}x {'faster' if ratio < 1 else 'slower'}{than}"


def _where(row):
    config, dtype, mask = row[:3]
    return f"{config} {dtype}{' causal' if mask == 'causal' else ''}"


def default_path_ratios(report):
    """``[(config, dtype, mask, ratio, flops)]`` of the layer's default path, forward+backward."""
    rows = []
    for r in report.get("records", []):
        stats = r.get("fwd_bwd")
        if (r.get("kind") == "layer" and r.get("impl") == "auto" and r.get("status") == "ok"
                and stats and stats.get("ratio_torch") is not None):
            rows.append((tuple(r["config"]), r["dtype"], r.get("mask", "none"),
                         stats["ratio_torch"], stats.get("flops")))
    return rows


def peak_memory(report):
    """``{(config, dtype): {"auto": MiB, "torch": MiB}}``: the layers' peak RSS, no mask, where both ran."""
    memory = {}
    for r in report.get("records", []):
        if (r.get("kind") == "layer" and r.get("impl") in ("auto", "torch")
                and r.get("mask", "none") == "none" and (r.get("memory") or {}).get("rss_mib") is not None):
            memory.setdefault((tuple(r["config"]), r["dtype"]), {})[r["impl"]] = r["memory"]["rss_mib"]
    return {key: value for key, value in memory.items() if len(value) == 2}


def _groups(rows):
    """(label, rows): small shapes, the other shapes up to L = 128, then each longer L."""
    def work(row):
        B, L, E, _ = row[0]
        return B * L * E

    small = [r for r in rows if work(r) <= SMALL_WORK]
    medium = [r for r in rows if work(r) > SMALL_WORK and r[0][1] <= MEDIUM_MAX_LENGTH]
    groups = []
    for label, members in ((f"small shapes (B*L*E <= {SMALL_WORK:,})", small),
                           (f"medium shapes (L <= {MEDIUM_MAX_LENGTH})", medium)):
        if members:
            shapes = ", ".join(str(c) for c in dict.fromkeys(r[0] for r in members))
            groups.append((f"{label[:-1]}: {shapes})", members))
    rest = [r for r in rows if work(r) > SMALL_WORK and r[0][1] > MEDIUM_MAX_LENGTH]
    for length in sorted({r[0][1] for r in rest}):
        members = [r for r in rest if r[0][1] == length]
        shapes = ", ".join(str(c) for c in dict.fromkeys(r[0] for r in members))
        groups.append((f"L = {length} ({shapes})", members))
    return groups


def summarize(report):
    """The run's results in plain sentences, one a line (also stored in the JSON report)."""
    lines = []
    rows = default_path_ratios(report)
    if rows:
        lines.append("MultiHeadAttention forward+backward, qkvnp's default path against PyTorch's "
                     "nn.MultiheadAttention:")
    elif report.get("records") and (report.get("environment") or {}).get("torch", "") is None:
        lines.append("No attention comparison with PyTorch was measured: PyTorch is not "
                     "installed.")
    elif report.get("records"):
        lines.append("No attention comparison with PyTorch was measured (is PyTorch installed? "
                     "did an implementation fail its check?)")
    for label, members in _groups(rows):
        ratios = [r[3] for r in members]
        mean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        line = f"  {label}: qkvnp is {speed_phrase(mean)}"
        if len(members) > 1:
            best, worst = min(members, key=lambda r: r[3]), max(members, key=lambda r: r[3])
            line += (f" (geometric mean of {len(members)} measurements); from "
                     f"{speed_phrase(best[3], '')} at {_where(best)} to "
                     f"{speed_phrase(worst[3], '')} at {_where(worst)}")
        lines.append(line + ".")
    both = peak_memory(report)
    if both:
        longest = max(config[1] for config, _ in both)
        for (config, dtype), value in sorted(both.items()):
            if config[1] == longest:
                lines.append(f"  Peak memory of one forward+backward at {config} {dtype}: qkvnp "
                             f"{value['auto']:.0f} MiB, PyTorch {value['torch']:.0f} MiB.")
    training = [t for t in report.get("training") or [] if t.get("qkvnp")]
    if training:
        lines.append("Training (one optimizer step: forward, loss, backward, Adam; the same "
                     "weights and batches in both):")
    for t in training:
        line = f"  {t['task']} {t['dtype']}: qkvnp {t['qkvnp']['steps_per_s']:.0f} steps/s"
        if t.get("torch"):
            line += (f", PyTorch {t['torch']['steps_per_s']:.0f} steps/s: qkvnp is "
                     f"{speed_phrase(1.0 / t['speedup'])}")
        lines.append(line + ".")
    for t in report.get("training") or []:
        if t.get("status") != "ok":
            lines.append(f"  {t['task']} {t['dtype']}: not timed: {t['reason']}")
    return lines


def ratio_table(report):
    """Lines of a table: one row per shape, one column per dtype and mask, of the ratios."""
    rows = default_path_ratios(report)
    if not rows:
        return []
    columns = sorted({(dtype, mask) for _, dtype, mask, _, _ in rows},
                     key=lambda c: (c[0], c[1] != "none"))
    ratios = {(config, dtype, mask): ratio for config, dtype, mask, ratio, _ in rows}
    flops = {config: f for config, _, _, _, f in rows}
    names = [f"{dtype}{' causal' if mask == 'causal' else ''}" for dtype, mask in columns]
    lines = ["qkvnp's default path time / PyTorch's, MultiHeadAttention forward+backward "
             "(below 1: qkvnp is faster)",
             f"{'(B, L, E, H)':<20}{'MFLOP':>9}" + "".join(f"{n:>16}" for n in names)]
    lines.append("-" * len(lines[-1]))
    for config in sorted(flops, key=lambda c: (flops[c] or 0, c)):
        cells = [ratios.get((config, dtype, mask)) for dtype, mask in columns]
        lines.append(f"{str(config):<20}{(flops[config] or 0) / 1e6:>9.3g}"
                     + "".join(format("-" if x is None else format(x, ".2f" if x >= 0.1 else ".2g"),
                                      ">16") for x in cells))
    return lines


def plot_ratios(report, path):
    """Draw the default path's time / PyTorch's against the work (fwd+bwd FLOPs), log axes.

    One series per dtype and mask, across the whole grid. Returns False,
    after saying how to install matplotlib, when it is missing.
    """
    plt = import_pyplot()
    if plt is None:
        return False

    series = {}
    for config, dtype, mask, ratio, flops in default_path_ratios(report):
        series.setdefault((dtype, mask), []).append((flops, ratio))
    figure, axis = plt.subplots(figsize=(9, 5.5))
    for (dtype, mask), points in sorted(series.items()):
        points.sort()
        axis.plot([p[0] for p in points], [p[1] for p in points],
                  "-" if dtype == "float32" else "--", marker="o" if mask == "none" else "s",
                  label=f"{dtype}, {'causal' if mask == 'causal' else 'no mask'}")
    axis.axhline(1.0, color="gray", linewidth=1)
    axis.set(xscale="log", yscale="log",
             xlabel="work: matmul FLOPs of one forward+backward",
             ylabel="qkvnp time / PyTorch time (below 1: qkvnp faster)",
             title="MultiHeadAttention forward+backward: qkvnp's default path against PyTorch")
    if series:
        axis.legend(fontsize="small")
    return save_figure(figure, plt, path)


def import_pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None after saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib, which is not installed: pip install 'qkvnp[plot]'",
              file=sys.stderr)
        return None
    return plt


def save_figure(figure, plt, path):
    """Write ``figure`` to ``path`` atomically, in the format its extension names; close it."""
    from qkvnp._io import atomic_write  # the package's one atomic write

    figure.tight_layout()
    path = os.fspath(path)
    extension = os.path.splitext(path)[1].lstrip(".") or "png"
    try:
        with atomic_write(path) as stream:
            figure.savefig(stream, format=extension)
    finally:
        plt.close(figure)
    return True
