"""What the Q/K/V ablation shows: its tables, the takeaway, the JSON summary and the plot.

Shape key: P stored pairs, E model width (``dim``).

:mod:`qkvnp.training.ablation` trains the runs and summarizes them
(:func:`~qkvnp.training.ablation.summarize`); this module turns the summary
into what a reader sees. Every sentence of :func:`takeaway` is chosen by the
numbers it is given. matplotlib is optional and imported only by
:func:`plot_ablation`.

Examples
--------
>>> rows = [{"task": "partner", "dim": 16, "variant": "tied_qk", "seed": 0,
...          "accuracy": 0.5, "parameters": 10}]
>>> from qkvnp.training.ablation import summarize
>>> format_table(summarize(rows))[1].split()
['16', 'tied_qk', '10', '1', '50.00%']
"""
import sys

import numpy as np

__all__ = [
    "ATTENTION_FIELDS",
    "percent",
    "format_table",
    "format_attention",
    "takeaway",
    "to_json",
    "pair_example",
    "plot_ablation",
]

# what qkvnp.training.ablation.partner_attention measures: its keys, and those of partner rows
ATTENTION_FIELDS = ("prefers_own", "weight_own", "weight_partner", "weight_gap")


def percent(fraction):
    """Percent with two decimals, the one rounding of the table and the takeaway."""
    return f"{100 * fraction:.2f}%"


def format_table(table):
    """The summary as aligned text lines (accuracies in percent, all rounded to 0.01).

    One run prints its accuracy alone (no spread, no min and max); several
    print ``mean ± sample standard deviation`` and the min and max over
    seeds. Where the attention goes is :func:`format_attention`'s table.
    """
    lines = [f"{'width':>5}  {'variant':<9} {'params':>7}  {'seeds':>5}  "
             f"{'held-out accuracy':>17}  {'min':>7}  {'max':>7}"]
    previous_dim = None
    for entry in table:
        if previous_dim is not None and entry["dim"] != previous_dim:
            lines.append("")
        previous_dim = entry["dim"]
        if entry["runs"] > 1:
            accuracy = f"{percent(entry['mean'])} ± {100 * entry['std']:.2f}"
            low, high = percent(entry["min"]), percent(entry["max"])
        else:
            accuracy, low, high = percent(entry["mean"]), "", ""
        line = (f"{entry['dim']:>5}  {entry['variant']:<9} {entry['parameters']:>7,}  "
                f"{entry['runs']:>5}  {accuracy:>17}  {low:>7}  {high:>7}")
        lines.append(line.rstrip())
    return lines


def format_attention(table):
    """Where partner queries put their attention, as aligned text lines (means over seeds).

    ``prefers own`` (percent of held-out sequences), the mean weights ``on
    own`` and ``on partner``, and ``|own - partner|`` per sequence (see
    :func:`partner_attention`); entries without these (kv-recall) are left out.
    """
    lines = [f"{'width':>5}  {'variant':<9} {'prefers own':>11}  {'on own':>6}  "
             f"{'on partner':>10}  {'|own - partner|':>15}"]
    previous_dim = None
    for entry in table:
        if entry["prefers_own"] is None:
            continue
        if previous_dim is not None and entry["dim"] != previous_dim:
            lines.append("")
        previous_dim = entry["dim"]
        lines.append(f"{entry['dim']:>5}  {entry['variant']:<9} "
                     f"{percent(entry['prefers_own']):>11}  {entry['weight_own']:>6.2f}  "
                     f"{entry['weight_partner']:>10.2f}  {entry['weight_gap']:>15.2f}")
    return lines if len(lines) > 1 else []


# ---------------------------------------------------------------- what the numbers say


def _by_variant(table, task, variant):
    return sorted((entry for entry in table if entry["task"] == task and entry["variant"] == variant),
                  key=lambda entry: entry["dim"])


def _widths(entries):
    return ", ".join(str(entry["dim"]) for entry in entries)


def takeaway(table):
    """One paragraph computed from :func:`summarize`'s table (no sentence is written in advance).

    Parameters
    ----------
    table : list of dict
        Entries of one or both tasks.

    Returns
    -------
    str
        Empty when the table holds neither ``separate`` nor a tied variant.
    """
    separate = _by_variant(table, "partner", "separate")
    tied = _by_variant(table, "partner", "tied_qk")
    shared = _by_variant(table, "partner", "shared")
    no_value = _by_variant(table, "partner", "no_value")
    sentences = []
    if tied:
        sentences.append(_tied_on_partner(tied, separate))
        sentences.append(_where_tied_attends(tied[-1]))
    if shared:
        best = max(entry["max"] for entry in shared)
        sentences.append(f"One shared matrix for Q, K and V is tied too and stays at "
                         f"{percent(best)} at best.")
    if no_value and separate:
        sentences.append(_cost_of_no_value(separate, no_value))
    sentences.append(_tied_on_kv_recall(table))
    return " ".join(sentence for sentence in sentences if sentence)


def _tied_on_partner(tied, separate):
    """Tied Q=K's best accuracy on partner against separate's, and what the pair bound says."""
    best = max(entry["max"] for entry in tied)
    own = [entry["prefers_own"] for entry in tied if entry["prefers_own"] is not None]
    plural = "s" if len(tied) > 1 else ""
    sentence = (f"On partner, tied Q=K {'reaches at most' if best <= 0.6 else 'reaches up to'} "
                f"{percent(best)} in any run (width{plural} {_widths(tied)}; mean{plural} "
                f"{', '.join(percent(entry['mean']) for entry in tied)})")
    if own:
        share = (percent(own[0]) if min(own) == max(own)
                 else f"{percent(min(own))} to {percent(max(own))}")
        sentence += (f", and its query weighs its own entry above its partner's in "
                     f"{share} of the held-out sequences")
    top = separate[-1] if separate else None
    if top is not None:
        sentence += (f", while separate W_query and W_key reach {percent(top['mean'])} at "
                     f"width {top['dim']} (min {percent(top['min'])})")
    if best > 0.6:
        sentence += (": above the pair bound's ceiling of about half (the values' embeddings "
                     "in the stored tokens can shift it only by chance), so look at the runs")
    elif top is not None and top["mean"] >= 0.9 and (not own or min(own) >= 0.48):
        sentence += (": for every pair of partners one of the two queries prefers its own "
                     "entry, as the pair bound says, so about half is tied Q=K's ceiling "
                     "whatever the width")
    elif top is not None and top["mean"] >= 0.9:
        under = min(tied, key=lambda entry: entry["prefers_own"])
        sentence += (f": a little under half prefer their own entry at width {under['dim']} "
                     f"({percent(under['prefers_own'])}). The pair bound is exact for the "
                     "keys' part of the scores; the value embeddings stored with the keys "
                     "add a term that changes sign when the two values are swapped, which "
                     "lets some more queries win (at most 3 of 4 in principle), and about "
                     "half stays tied Q=K's ceiling")
    else:
        sentence += (": separate projections did not learn the task either, so these runs "
                     "are too short or too narrow to tell the variants apart")
    return sentence + "."


def _where_tied_attends(widest):
    """Where tied Q=K's queries put their attention at its widest width ("" without weights)."""
    if widest["weight_own"] is None:
        return ""
    gap = widest["weight_gap"]
    weights = (f"mean weight {widest['weight_own']:.2f} on its own entry, "
               f"{widest['weight_partner']:.2f} on its partner's, {gap:.2f} apart per "
               "sequence")
    if gap <= 0.2 and min(widest["weight_own"], widest["weight_partner"]) >= 0.25:
        return (f"At width {widest['dim']} each query splits its attention between the two "
                f"entries ({weights}): training made partners alike under W W^T, so the "
                "readout gets half of each value and can only guess which one was asked for.")
    if gap >= 0.6:
        return (f"At width {widest['dim']} each query puts its attention on one of the two "
                f"entries ({weights}): about half on the partner, the rest on their own "
                "entry, which is all the bound allows.")
    return f"At width {widest['dim']}: {weights}."


def _cost_of_no_value(separate, no_value):
    """What dropping W_value costs on partner, at the width where it costs most ("" if no
    width has both)."""
    gaps = [(s["mean"] - n["mean"], s["dim"], s["mean"], n["mean"])
            for s, n in zip(separate, no_value) if s["dim"] == n["dim"]]
    if not gaps:
        return ""
    gap, dim, with_value, without = max(gaps)
    if gap > 0.01:
        return (f"Dropping W_value (the attended tokens themselves are the values) costs up "
                f"to {100 * gap:.2f} points, at width {dim} ({percent(without)} against "
                f"{percent(with_value)}): without it the stored key's embedding reaches "
                "the readout mixed into every value, and the embeddings must keep the two "
                "apart in the dimensions they share.")
    return (f"Dropping W_value costs at most {100 * max(gap, 0.0):.2f} points here "
            f"(width {dim}: {percent(without)} against {percent(with_value)}).")


def _tied_on_kv_recall(table):
    """Tied Q=K against separate on kv-recall, the symmetric task ("" without both)."""
    kv_separate = _by_variant(table, "kv-recall", "separate")
    kv_tied = _by_variant(table, "kv-recall", "tied_qk")
    if not (kv_separate and kv_tied):
        return ""
    top_s, top_t = kv_separate[-1], kv_tied[-1]
    difference = top_t["mean"] - top_s["mean"]
    relation = ("as well as" if abs(difference) <= 0.01
                else "better than" if difference > 0 else "less well than")
    return (f"On kv-recall, where the query asks for its own key (a symmetric relation), tied "
            f"Q=K does {relation} separate projections ({percent(top_t['mean'])} against "
            f"{percent(top_s['mean'])} at width {top_s['dim']})"
            + (": that task alone cannot show why queries and keys need their own matrices."
               if difference >= -0.01 else "."))


def to_json(table, steps):
    """The ``--json`` document: ``{task: [entry, ...]}`` (accuracies as fractions in [0, 1]).

    Each entry holds ``variant, width, seeds`` (the list of seeds),
    ``accuracy_mean, accuracy_min, accuracy_max``, and also ``accuracy_std``
    (sample standard deviation, 0 for one seed), ``accuracies`` (per seed,
    in the order of ``seeds``), ``parameters``, ``steps`` and, on partner,
    ``prefers_own``, ``weight_own``, ``weight_partner``, ``weight_gap``
    (:func:`partner_attention`, means over seeds).
    """
    document = {}
    for entry in table:
        item = {"variant": entry["variant"], "width": entry["dim"], "seeds": entry["seeds"],
                "accuracy_mean": entry["mean"], "accuracy_min": entry["min"],
                "accuracy_max": entry["max"], "accuracy_std": entry["std"],
                "accuracies": entry["accuracies"], "parameters": entry["parameters"],
                "steps": steps}
        if entry["prefers_own"] is not None:
            item.update((field, entry[field]) for field in ATTENTION_FIELDS)
        document.setdefault(entry["task"], []).append(item)
    return document


# ---------------------------------------------------------------- plot


def pair_example(models, seed=0, base=None):
    """Attention of two partner queries ``a`` and ``b = pi(a)`` over the same stored items.

    The first held-out sequence of the partner task (seed ``seed``) is asked
    twice: for its query key ``a`` and for ``a``'s partner ``b``; both are
    stored in it. Separate projections put each query's weight on the
    other's entry; with ``Q = K`` the pair bound makes at least one of the
    two rows sit on its own entry.

    Parameters
    ----------
    models : dict
        Label -> trained partner :class:`KVRecallModel` (the same task
        settings and ``seed``).
    seed : int
        The run's seed (it fixes the pairing and the held-out set).
    base : dict, optional
        The task's :class:`TrainConfig` fields (``num_keys`` ...).

    Returns
    -------
    weights : dict
        Label -> ndarray ``(2, P)``: row 0 asks ``a``, row 1 asks ``b``.
    xlabels : list of str
        ``key:value`` per stored item, ``a`` and ``b`` marked.
    ylabels : list of str
    """
    from .loop import TrainConfig, build_task
    from .tasks import make_streams

    config = TrainConfig(**{**dict(base or {}), "task": "partner", "seed": seed}).resolved()
    streams = make_streams(seed)
    task = build_task(config, streams.teacher)
    one = task.sample(streams.heldout, config.eval_size)  # the run's held-out set
    keys = np.repeat(one.keys[:1], 2, axis=0)  # (1, P) -> (2, P)
    values = np.repeat(one.values[:1], 2, axis=0)  # (1, P) -> (2, P)
    a = int(one.query[0])
    b = int(task.partner[a])
    query = np.array([a, b])  # (2,)
    weights = {label: model.forward(keys, values, query, return_weights=True)[1]  # (2, P)
               for label, model in models.items()}
    xlabels = [f"{k}:{v}" + (" (a)" if k == a else " (b)" if k == b else "")
               for k, v in zip(keys[0].tolist(), values[0].tolist())]
    return weights, xlabels, [f"asks a={a}", f"asks b={b}"]


def plot_ablation(table, path, example=None, stream=None):
    """Accuracy against width (one panel per task, one line per variant) and the pair heat maps.

    matplotlib is optional (``pip install 'qkvnp[plot]'``); without it this
    prints how to install it and returns False. The figure is written
    atomically (:func:`qkvnp._io.atomic_write`).

    Parameters
    ----------
    table : list of dict
        :func:`summarize`'s entries.
    path : str or os.PathLike
        Output file; its extension (png, pdf, svg) picks the format.
    example : tuple, optional
        :func:`pair_example`'s result, drawn as one heat map per model.
    stream : file, optional
        Where the messages go (default ``sys.stdout``).

    Returns
    -------
    bool
        True if the figure was written.
    """
    from .report import figure_class, save_figure

    stream = sys.stdout if stream is None else stream
    Figure = figure_class(f"--plot {path}", "The results above are unaffected.", stream)
    if Figure is None:
        return False
    tasks = list(dict.fromkeys(entry["task"] for entry in table))
    weights = {} if example is None else example[0]
    panels = len(tasks) + len(weights)
    figure = Figure(figsize=(4.5 * panels, 4.2), layout="constrained")
    axes = list(figure.subplots(1, panels, squeeze=False)[0])  # (1, panels) -> panels
    for ax, task in zip(axes, tasks):
        for variant in dict.fromkeys(entry["variant"] for entry in table):
            entries = _by_variant(table, task, variant)
            if not entries:
                continue
            dims = [entry["dim"] for entry in entries]
            means = np.array([100 * entry["mean"] for entry in entries])
            spread = np.array([[100 * (entry["mean"] - entry["min"]) for entry in entries],
                               [100 * (entry["max"] - entry["mean"]) for entry in entries]])
            ax.errorbar(dims, means, yerr=spread, marker="o", capsize=3, label=variant)
        if task == "partner":
            ax.axhline(50, color="gray", linestyle="--", linewidth=0.8,
                       label="about half: the pair bound for Q = K")
        ax.set_xscale("log", base=2)
        widths = sorted({entry["dim"] for entry in table if entry["task"] == task})
        ax.set_xticks(widths, [str(width) for width in widths])  # 8, 16, 32 rather than 2^3 ...
        ax.minorticks_off()
        ax.set_xlabel("width E")
        ax.set_ylabel("held-out accuracy (%), min to max over seeds")
        ax.set_ylim(0, 102)
        ax.set_title(task)
        ax.legend(fontsize=8)
    for ax, (label, matrix) in zip(axes[len(tasks):], weights.items()):
        xlabels, ylabels = example[1], example[2]
        image = ax.imshow(matrix, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(len(xlabels)), xlabels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(ylabels)), ylabels)
        ax.set_title(f"partner, {label}: attention of a and of its partner b", fontsize=9)
        ax.set_xlabel("stored key:value")
        figure.colorbar(image, ax=ax, label="attention weight")
    save_figure(figure, path)
    print(f"plot written to {path}", file=stream)
    return True
