"""What a check costs: the entries it samples, its estimate, its progress.

Shape key: none; a checked tensor may have any shape.

Every numerical derivative costs forwards: an elementwise central check of a
tensor of ``n`` entries costs ``2 n`` forwards, so a whole model
(``GPTModel``, 10^5 to 10^8 parameters) would take hours entry by entry.
The checker therefore

* samples: with ``sample="auto"`` (the default) an elementwise check of more
  than :data:`SAMPLE_ABOVE` entries in all checks :data:`AUTO_SAMPLE` random
  entries of each tensor (every entry of a smaller tensor); ``sample=k``
  checks ``k`` per tensor, ``sample=None`` every entry. The report says what
  it sampled (``report.sampled``);
* estimates the cost, forwards times the time of the check's first forward,
  and shows progress on ``stderr`` (or a given stream) when the estimate
  exceeds :data:`PROGRESS_AFTER` seconds.

``mode="joint"`` is the cheapest meaningful check of a large model: random
unit directions over every checked tensor at once, two forwards each
(central differences) whatever the model's size.
"""
import sys
import time

import numpy as np

from .._checks import check_int
from .stencils import RIDDERS_STEPS

__all__ = ["SAMPLE_ABOVE", "AUTO_SAMPLE", "PROGRESS_AFTER", "FORWARDS", "check_sample",
           "choose_entries", "count_forwards", "Meter", "make_meter"]

#: Entries of an elementwise check (all tensors) beyond which ``sample="auto"`` samples.
SAMPLE_ABOVE = 20_000
#: Entries per tensor that ``sample="auto"`` checks when it samples.
AUTO_SAMPLE = 32
#: Seconds: a check estimated longer shows its progress (``progress=None``).
PROGRESS_AFTER = 5.0
#: Forwards per entry or direction, by method (Ridders': at most).
FORWARDS = {"central": 2, "central4": 4, "richardson": 2 * RIDDERS_STEPS, "complex_step": 1}


def check_sample(sample):
    """``sample`` as ``"auto"``, None or an int >= 1 (``ValueError``/``TypeError`` otherwise)."""
    if sample is None or (isinstance(sample, str) and sample == "auto"):
        return sample
    if isinstance(sample, bool) or not isinstance(sample, (int, np.integer)):
        raise TypeError(f'sample must be "auto", None or an int >= 1, got '
                        f'{type(sample).__name__} {sample!r}')
    return check_int(sample, "sample", 1, None, expected='"auto", None or an int >= 1')


def choose_entries(shapes, sample, rng):
    """The entries an elementwise check perturbs, and the words that say so.

    Parameters
    ----------
    shapes : dict of str -> tuple
        The checked tensors' shapes.
    sample : "auto", None or int
        See the module docstring.
    rng : numpy.random.Generator
        Draws the sampled entries (without replacement, per tensor).

    Returns
    -------
    entries : dict of str -> list of index tuples, or None
        None for a tensor checked entry by entry in full.
    words : str
        Empty when nothing was sampled, else e.g. ``"32 random entries of
        each tensor over 32 entries: 1,024 of 163,009,536 entries"``.
    """
    sizes = {name: int(np.prod(shape, dtype=np.int64)) for name, shape in shapes.items()}
    total = sum(sizes.values())
    if sample == "auto":
        sample = AUTO_SAMPLE if total > SAMPLE_ABOVE else None
    if sample is None:
        return {name: None for name in shapes}, ""
    entries = {}
    for name, shape in shapes.items():
        if sizes[name] <= sample:
            entries[name] = None
            continue
        flat = rng.choice(sizes[name], size=sample, replace=False)
        entries[name] = [tuple(int(i) for i in np.unravel_index(f, shape)) for f in np.sort(flat)]
    checked = sum(sizes[name] if chosen is None else len(chosen)
                  for name, chosen in entries.items())
    if checked == total:
        return {name: None for name in shapes}, ""
    return entries, (f"{sample} random entries of each tensor over {sample} entries: "
                     f"{checked:,} of {total:,} entries checked")


def count_forwards(shapes, entries, method, mode, num_directions):
    """Forwards the numerical side of a check takes (at most, for Ridders')."""
    per = FORWARDS[method]
    if mode == "joint":
        return per * num_directions
    if mode == "direction":
        return per * num_directions * len(shapes)
    return per * sum(int(np.prod(shape, dtype=np.int64)) if entries.get(name) is None
                     else len(entries[name]) for name, shape in shapes.items())


def _duration(seconds):
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Meter:
    """Progress of a check's forwards on a stream: a live line on a terminal, else lines.

    Parameters
    ----------
    stream : file
        Where the lines go (``sys.stderr`` by default in :func:`make_meter`).
    total : int
        Forwards expected.
    seconds_per_forward : float
        The first forward's time: the estimate before any progress.
    interval : float
        Seconds between two lines (a terminal's line is redrawn every 0.2 s).
    """

    def __init__(self, stream, total, seconds_per_forward, interval=10.0):
        self.stream, self.total, self.done = stream, max(int(total), 1), 0
        isatty = getattr(stream, "isatty", None)
        self.live = bool(isatty()) if callable(isatty) else False
        self.interval = 0.2 if self.live else interval
        self.started = self.last = time.perf_counter()
        estimate = self.total * seconds_per_forward
        self._write(f"gradcheck: {self.total:,} forwards of about {seconds_per_forward:.3g}s "
                    f"each: about {_duration(estimate)}", end="\n")

    def _write(self, text, end):
        prefix = "\r\033[K" if self.live else ""
        self.stream.write(prefix + text + end)
        self.stream.flush()

    def tick(self):
        """Count one forward; draw a line when ``interval`` seconds passed."""
        self.done += 1
        now = time.perf_counter()
        if now - self.last >= self.interval:
            self.last = now
            elapsed = now - self.started
            left = elapsed / self.done * max(self.total - self.done, 0)
            self._write(f"gradcheck: {self.done:,}/{self.total:,} forwards, "
                        f"{_duration(elapsed)} elapsed, about {_duration(left)} left",
                        end="" if self.live else "\n")

    def close(self):
        """The last line: forwards done and the time taken."""
        elapsed = time.perf_counter() - self.started
        self._write(f"gradcheck: {self.done:,} forwards in {_duration(elapsed)}", end="\n")


def make_meter(progress, total, seconds_per_forward):
    """A :class:`Meter`, or None for a quiet check.

    Parameters
    ----------
    progress : None, bool or file
        None: on ``sys.stderr`` when ``total * seconds_per_forward`` exceeds
        :data:`PROGRESS_AFTER`; False: never; True: on ``sys.stderr``; a
        file (anything with ``write``): there, always.
    total : int
    seconds_per_forward : float
    """
    if progress is None:
        if total * seconds_per_forward <= PROGRESS_AFTER:
            return None
        return Meter(sys.stderr, total, seconds_per_forward)
    if progress is False:
        return None
    if progress is True:
        return Meter(sys.stderr, total, seconds_per_forward)
    if not callable(getattr(progress, "write", None)):
        raise TypeError(f"progress must be None, a bool or a stream with write(), got "
                        f"{type(progress).__name__}")
    return Meter(progress, total, seconds_per_forward)
