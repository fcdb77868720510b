"""What a training run shows: the progress line, the summary, the plot.

Shape key: P stored key/value pairs, T sequence length, H heads.

:func:`qkvnp.training.loop.train` prints nothing; ``python -m qkvnp train``
(:func:`qkvnp.training.command.run`) passes it a :class:`Progress` callback, prints
:func:`describe` before and :func:`summary` after the run, and calls
:func:`plot_run` for ``--plot``. matplotlib is optional and imported only
by :func:`plot_run`.
"""
import math
import os
import sys
import time

import numpy as np

from .._io import atomic_write
from .config import LOOKUP_TASKS

__all__ = ["Progress", "describe", "summary", "lookup_attention", "attention_example",
           "plot_run", "figure_class", "save_figure"]


# ---------------------------------------------------------------- text


def describe(config, model):
    """One line naming the run's task, model, optimizer and data (printed before training).

    Parameters
    ----------
    config : qkvnp.training.loop.TrainConfig
        Resolved.
    model : KVRecallModel or AttentionRegressor
        Only its parameter count is read.

    Returns
    -------
    str
    """
    if config.task in LOOKUP_TASKS:
        asked = ("" if config.task == "kv-recall"
                 else ", answer: the value of the query key's partner")
        what = (f"{config.task}: {config.num_pairs} key/value pairs per sequence "
                f"(keys of {config.num_keys}, values of {config.num_values}{asked}), "
                f"variant {config.variant}, width {config.dim}")
    else:
        what = (f"teacher: student MultiHeadAttention(E={config.embed_dim}, H={config.num_heads}) "
                f"on sequences of {config.seq_len}")
    return (f"{what}; {model.num_parameters():,} parameters, {config.optimizer} lr "
            f"{config.lr:g} {config.schedule}, batch {config.batch_size}, seed {config.seed}, "
            f"{config.dtype}")


def summary(result):
    """The final summary lines of a run: where it stopped, its speed, its held-out metrics.

    Parameters
    ----------
    result : qkvnp.training.loop.TrainResult

    Returns
    -------
    list of str
        The speed counts this session's steps only (``result.history`` also
        holds those before a resume); the held-out line gives the accuracy
        against chance (kv-recall, partner) or the MSE's drop from step 0 (teacher).
    """
    config = result.config
    steps_done = result.step - result.start_step
    rate = steps_done / result.seconds if result.seconds > 0 else float("inf")
    lines = [f"{'stopped' if result.interrupted else 'done'} at step {result.step}/{config.steps}: "
             f"{steps_done} steps in {result.seconds:.1f}s ({rate:,.0f} steps/s)"]
    heldout = result.heldout
    if config.task in LOOKUP_TASKS:
        correct = int(round(heldout["accuracy"] * config.eval_size))
        lines.append(f"held-out accuracy {100 * heldout['accuracy']:.2f}% ({correct}/"
                     f"{config.eval_size} sequences; chance {100 / config.num_values:.1f}%), "
                     f"held-out loss {heldout['loss']:.4g}")
    else:
        drop = result.initial_heldout["loss"] / heldout["loss"] if heldout["loss"] > 0 else float("inf")
        lines.append(f"held-out MSE {heldout['loss']:.3e}, down {drop:.3g}x from "
                     f"{result.initial_heldout['loss']:.3e} at step 0")
    if result.checkpoint:
        lines.append(f"checkpoint saved to {result.checkpoint}")
    return lines


# ---------------------------------------------------------------- progress


def _format_duration(seconds):
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    """Progress of :func:`qkvnp.training.loop.train`: a live line on a terminal, plain lines otherwise.

    Parameters
    ----------
    stream : file, optional
        Default ``sys.stderr``.
    live : bool, optional
        Rewrite one line with ``\\r`` (default: whether ``stream`` is a tty).
    interval : float
        Minimum seconds between two live redraws.
    plain_interval : float
        Without a terminal, also print a line when this many seconds passed
        since the last one (evaluations may be far apart).

    Notes
    -----
    Each line shows the step, the training loss (mean of the steps since the
    last line), the training accuracy, the last held-out metrics, the
    learning rate, steps per second since the (re)start, and the time left
    at that rate. Without a terminal, one line is printed per held-out
    evaluation, and at least every ``plain_interval`` seconds.
    """

    def __init__(self, stream=None, live=None, interval=0.1, plain_interval=10.0):
        self.stream = sys.stderr if stream is None else stream
        self.live = _isatty(self.stream) if live is None else bool(live)
        self.interval = interval
        self.plain_interval = plain_interval
        self._started = None
        self._last_draw = time.perf_counter()
        self._losses, self._accuracies = [], []
        self._heldout = None
        self._width = 0

    def __call__(self, info):
        now = time.perf_counter()
        if self._started is None:
            self._started = (now, info["start_step"])
        self._losses.append(info["loss"])
        if info["accuracy"] is not None:
            self._accuracies.append(info["accuracy"])
        if info["heldout"] is not None:
            self._heldout = info["heldout"]
        last = info["step"] == info["steps"]
        if self.live:
            if last or now - self._last_draw >= self.interval:
                self._draw(info, now, end="\n" if last else "")
        elif info["heldout"] is not None or last or now - self._last_draw >= self.plain_interval:
            self._draw(info, now, end="\n")

    def _draw(self, info, now, end):
        start_time, start_step = self._started
        done = info["step"] - start_step
        # NOTE: the loop's own clock (``seconds``) includes the first step; this
        # callback's first call would measure no time at all ("inf steps/s")
        elapsed = info.get("seconds", now - start_time)
        rate = done / elapsed if elapsed > 0 else math.nan
        left = (info["steps"] - info["step"]) / rate if rate > 0 else math.nan
        width = len(str(info["steps"]))
        parts = [f"step {info['step']:>{width}}/{info['steps']}",
                 f"loss {np.mean(self._losses):.4g}"]
        if self._accuracies:
            parts.append(f"acc {100 * np.mean(self._accuracies):5.1f}%")
        if self._heldout is not None:
            if self._heldout["accuracy"] is not None:
                parts.append(f"held-out {100 * self._heldout['accuracy']:5.1f}%")
            else:
                parts.append(f"held-out loss {self._heldout['loss']:.3g}")
        parts += [f"lr {info['lr']:.2g}",
                  f"{rate:,.0f} steps/s" if math.isfinite(rate) else "? steps/s",
                  f"left {_format_duration(left)}"]
        line = "  ".join(parts)
        if self.live:
            padded = line.ljust(self._width)  # erase the end of a longer previous line
            self._width = 0 if end else len(line)
            self.stream.write("\r" + padded + end)
        else:
            self.stream.write(line + end)
        self.stream.flush()
        self._last_draw = now
        self._losses, self._accuracies = [], []

    def close(self):
        """End a live line that was interrupted before the last step."""
        if self.live and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


def _isatty(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# ---------------------------------------------------------------- plot


def lookup_attention(model, batch, index=0):
    """The query's attention over the stored items of one kv-recall or partner sequence.

    Parameters
    ----------
    model : KVRecallModel
    batch : KVBatch or PartnerBatch
    index : int
        Which sequence of ``batch``.

    Returns
    -------
    weights : ndarray, shape (1, P)
    xlabels : list of str
        ``key:value`` per stored item; on partner, the query's own entry is
        marked ``(own)`` and the partner's ``(partner)``.
    ylabels : list of str
    title : str
    """
    one = type(batch)(*(field[index:index + 1] for field in batch))
    logits, weights = model.forward(one.keys, one.values, one.query,
                                    return_weights=True)  # (1, V), (1, P)
    xlabels = [f"{k}:{v}" for k, v in zip(one.keys[0], one.values[0])]
    predicted = int(np.argmax(logits[0]))
    query = int(one.query[0])
    if hasattr(one, "own"):  # partner
        xlabels[int(one.own[0])] += " (own)"
        xlabels[int(one.position[0])] += " (partner)"
        title = (f"query key {query}, partner {int(one.keys[0, one.position[0]])}: "
                 f"value {int(one.target[0])}, predicted {predicted}")
    else:
        title = f"query key {query}: stored value {int(one.target[0])}, predicted {predicted}"
    return weights, xlabels, ["query"], title


def attention_example(result, index=0):
    """Attention weights of one held-out sequence, ready for a heat map.

    Parameters
    ----------
    result : qkvnp.training.loop.TrainResult
    index : int
        Which held-out sequence (of a regenerated held-out set).

    Returns
    -------
    weights : ndarray, 2-D
        kv-recall and partner: ``(1, P)``, the query over the stored items; teacher:
        ``(T, T)``, head 0 of the student.
    xlabels, ylabels : list of str
    title : str
    """
    from .tasks import make_streams

    config = result.config
    batch = result.task.sample(make_streams(config.seed).heldout, index + 1)
    if config.task in LOOKUP_TASKS:
        return lookup_attention(result.model, batch, index)
    _, weights = result.model.forward(batch.x[index:index + 1],
                                      return_weights=True)  # (1, T, E), (1, H, T, T)
    T = weights.shape[-1]
    labels = [str(t) for t in range(T)]
    return weights[0, 0], labels, labels, "student head 0: query token (row) over key tokens"


def plot_run(result, path, stream=None):
    """Save the loss curve and one held-out attention heat map to ``path``.

    matplotlib is optional (``pip install 'qkvnp[plot]'``); without it this
    prints how to install it and returns False instead of raising. The figure
    goes through a temporary file renamed over ``path``. After ``--resume``,
    the loss curve still starts at step 1 (checkpoints store the history).

    Parameters
    ----------
    result : qkvnp.training.loop.TrainResult
    path : str or os.PathLike
        Output file; its extension (png, pdf, svg) picks the format.
    stream : file, optional
        Where the messages go (default ``sys.stdout``).

    Returns
    -------
    bool
        True if the figure was written.
    """
    stream = sys.stdout if stream is None else stream
    Figure = figure_class(f"--plot {path}", "Training results are unaffected.", stream)
    if Figure is None:
        return False
    history = result.history
    figure = Figure(figsize=(11, 4), layout="constrained")
    loss_axes, heat_axes = figure.subplots(1, 2, gridspec_kw={"width_ratios": (1, 1.2)})
    if history["step"]:
        loss_axes.plot(history["step"], history["loss"], lw=0.8, alpha=0.6, label="training batch")
    if history["eval_step"]:
        loss_axes.plot(history["eval_step"], history["eval_loss"], "o-", ms=3, label="held-out")
    loss_axes.set_yscale("log")
    loss_axes.set_xlabel("step")
    lookup = result.config.task in LOOKUP_TASKS
    loss_axes.set_ylabel("cross-entropy" if lookup else "MSE")
    loss_axes.set_title(f"{result.config.task}: loss")
    if history["step"] or history["eval_step"]:
        loss_axes.legend()
    weights, xlabels, ylabels, title = attention_example(result)
    image = heat_axes.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    heat_axes.set_xticks(range(len(xlabels)), xlabels, rotation=90, fontsize=7)
    heat_axes.set_yticks(range(len(ylabels)), ylabels)
    heat_axes.set_title(title, fontsize=9)
    heat_axes.set_xlabel("stored key:value" if lookup else "key token")
    figure.colorbar(image, ax=heat_axes, label="attention weight")
    save_figure(figure, path)
    print(f"plot written to {path}", file=stream)
    return True


def figure_class(what, consequence, stream):
    """matplotlib's ``Figure``, or None after printing how to install matplotlib.

    Parameters
    ----------
    what : str
        What asked for the plot (``"--plot out.png"``), the message's start.
    consequence : str
        What the missing plot leaves unaffected, the message's end.
    stream : file
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(f"{what}: matplotlib is not installed; install it with pip install "
              f"'qkvnp[plot]' (or pip install matplotlib). {consequence}", file=stream)
        return None
    return Figure


def save_figure(figure, path):
    """Write ``figure`` to ``path`` with :func:`qkvnp._io.atomic_write` (format: the extension)."""
    path = os.fspath(path)
    with atomic_write(path) as f:
        figure.savefig(f, format=os.path.splitext(path)[1][1:] or "png", dpi=120)
