"""The error-versus-step picture of ``gradcheck --sweep-eps --plot F``.

Shape key: ``K`` steps of the sweep.

One log-log panel per checked layer: for each method and dtype, the worst
relative error over the layer's tensors against the step ``h``, the fitted
slopes of both branches in the legend, and the textbook optimum step of the
method (``(3 eps)^(1/3)`` for central, ``eps^(1/5)`` for central4) as a
dotted vertical line. matplotlib is optional (``pip install 'qkvnp[plot]'``)
and imported here only, when a plot is asked for.
"""
import os
import sys

from .._io import atomic_write

__all__ = ["plot_sweep", "have_matplotlib"]

_STYLE = {"central": "o-", "central4": "s-", "complex_step": "^-", "richardson": "d-"}
_COLORS = {("central", "float64"): "C0", ("central", "float32"): "C1",
           ("central4", "float64"): "C2", ("central4", "float32"): "C3",
           ("complex_step", "float64"): "C4"}


def have_matplotlib():
    """True if ``matplotlib.figure`` imports (checked before a long sweep starts)."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        return False
    return True


def _slope(value):
    return "-" if value is None else f"{value:+.2f}"


def plot_sweep(result, path, stream=None):
    """Draw :func:`qkvnp.gradcheck.sweep.sweep_steps`'s ``result`` to ``path``.

    Parameters
    ----------
    result : dict
        ``{"eps", "curves", "summary"}`` of the sweep.
    path : str or os.PathLike
        Output file; its extension (png, pdf, svg) picks the format. Written
        through a temporary file renamed over ``path``.
    stream : file, optional
        Where the messages go (default ``sys.stdout``).

    Returns
    -------
    bool
        True if the figure was written, False without matplotlib (after
        saying how to install it).
    """
    stream = sys.stdout if stream is None else stream
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed; install it with "
              "pip install 'qkvnp[plot]'  (or pip install matplotlib)", file=stream)
        return False
    titles = list(dict.fromkeys(entry["problem"] for entry in result["summary"]))
    figure = Figure(figsize=(6.5 * len(titles), 5), layout="constrained")
    axes_list = figure.subplots(1, len(titles), squeeze=False)[0]
    for axes, title in zip(axes_list, titles):
        for entry in (e for e in result["summary"] if e["problem"] == title):
            key = (entry["method"], entry["dtype"])
            color = _COLORS.get(key)
            label = (f"{entry['method']} {entry['dtype']}: slopes "
                     f"{_slope(entry['truncation_slope'])} / {_slope(entry['roundoff_slope'])}")
            errors = [e if e > 0 else float("nan") for e in entry["errors"]]
            axes.plot(result["eps"], errors, _STYLE.get(entry["method"], "o-"), color=color,
                      ms=4, label=label)
            if entry["optimal_eps"] is not None:
                axes.axvline(entry["optimal_eps"], color=color, ls=":", lw=1)
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xlabel("step h (dotted: each method's optimum, (3 eps)^(1/3) and eps^(1/5))")
        axes.set_ylabel("max relative error over the tensors")
        axes.set_title(title, fontsize=9)
        axes.grid(True, which="major", alpha=0.3)
        axes.legend(fontsize=7, title="slopes: truncation / round-off", title_fontsize=7)
    path = os.fspath(path)
    with atomic_write(path) as f:
        figure.savefig(f, format=os.path.splitext(path)[1][1:] or "png", dpi=110)
    print(f"plot written to {path}", file=stream)
    return True
