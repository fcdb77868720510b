"""Training checkpoints: one ``.npz`` archive, written atomically, read without pickle.

Shape key: N steps taken (``meta/step``), M held-out evaluations.

A checkpoint holds everything a run needs to continue as if it had never
stopped: the parameters, the optimizer's state, the step, the state of the
generator that draws the training batches, the run's configuration, and its
history so far (so that the loss curve of a resumed run starts at step 1).

Layout of the archive (every entry a plain numeric or unicode array)::

    meta/magic             "qkvnp-checkpoint"
    meta/format_version    int64, FORMAT_VERSION
    meta/step              int64, optimizer steps taken (N)
    meta/config            JSON text of the configuration
    meta/rng_state         JSON text of ``Generator.bit_generator.state``
    meta/generator_states  JSON text ``{name: bit_generator.state}`` of the run's
                           other Generators: the model's own (the layers' dropout
                           draws) and, for the text task, ``"sample"`` (the
                           printed samples'); optional for the kv-recall, partner
                           and teacher tasks (files written before it existed
                           had none to save)
    param/<name>           one array per model parameter
    optim/<key>            one array per entry of ``optimizer.state_dict()``
    history/step           int64, shape (N,): 1, 2, ..., N
    history/loss           float64, shape (N,): training loss of each step
    history/accuracy       float64, shape (N,): training accuracy (NaN: none, teacher task)
    history/lr             float64, shape (N,): learning rate of each step
    history/eval_step      int64, shape (M,): strictly increasing, within 1..N
    history/eval_loss      float64, shape (M,): held-out loss at those steps
    history/eval_accuracy  float64, shape (M,): held-out accuracy (NaN: none)

Writing goes to a temporary file in the destination's directory, which is
flushed, fsync'ed and renamed over the destination (``os.replace``), so that a
crash leaves either the old file or the new one, never half of one.

Reading checks before it loads: the zip directory and each entry's ``.npy``
header give every name, shape and dtype for a few bytes each; they are
checked against the format, against each other (the history fits
``meta/step``) and against what the stored configuration implies, before any
array's data is read, without pickle. Anything unexpected (a directory, not
a zip archive, truncated, an object array, a header that does not match its
size, a missing or unknown entry, another format version, a non-finite
parameter) is a :class:`CheckpointError` naming the file and the entry.

Format versions: 1 had no ``history/`` entries; 2 (this one) adds them.
Version 1 files are refused, with the advice to train again (see
:func:`load_checkpoint`).
"""
from __future__ import annotations

import json
import math
import os
import stat
import zipfile
from collections import namedtuple

import numpy as np

from .._checks import check_int
from .._io import atomic_write

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any, Callable
    from .._typing import FloatArray

__all__ = [
    "FORMAT_VERSION",
    "HISTORY_FIELDS",
    "CheckpointError",
    "Checkpoint",
    "ArraySpec",
    "MAX_TEXT",
    "save_checkpoint",
    "load_checkpoint",
    "check_params_match",
    "write_npz_atomic",
]

FORMAT_VERSION = 2
MAGIC = "qkvnp-checkpoint"
_META = ("meta/magic", "meta/format_version", "meta/step", "meta/config", "meta/rng_state")
_GENERATORS = "meta/generator_states"  # optional
# the training history: fields with one entry per step, then one per held-out evaluation
_PER_STEP = ("step", "loss", "accuracy", "lr")
_PER_EVAL = ("eval_step", "eval_loss", "eval_accuracy")
HISTORY_FIELDS = _PER_STEP + _PER_EVAL
_STEP_FIELDS = ("step", "eval_step")  # int64; every other field is float64
_HISTORY = tuple("history/" + name for name in HISTORY_FIELDS)

Checkpoint = namedtuple("Checkpoint",
                        "params optimizer_state step rng_state config history format_version path "
                        "generator_states", defaults=({},))
ArraySpec = namedtuple("ArraySpec", "shape dtype")
ArraySpec.__doc__ = "What an ``.npy`` header declares: ``shape`` (tuple) and ``dtype``."
MAX_TEXT = 2**16  # characters of meta/config and meta/rng_state (a real one has < 2,000)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: the message says why."""


def write_npz_atomic(path, arrays):
    """Write ``arrays`` (dict name -> ndarray) to ``path`` as an ``.npz``, atomically.

    The archive is written to a temporary file beside ``path``, flushed and
    fsync'ed, then renamed over ``path``; on any error the temporary file is
    removed and ``path`` is left as it was.

    Parameters
    ----------
    path : str or os.PathLike
    arrays : dict of str to array_like
        Object arrays are refused (they would need pickle to read back).

    Returns
    -------
    str
        ``path``.
    """
    path = os.fspath(path)
    for name, value in arrays.items():
        if np.asarray(value).dtype.hasobject:
            raise TypeError(f"arrays[{name!r}] has dtype object; checkpoints hold only "
                            "numeric and unicode arrays")
    with atomic_write(path) as f:
        np.savez(f, **arrays)
    return path


def save_checkpoint(path: str | str | os.PathLike[str], params: dict[str, FloatArray],
                    optimizer_state: dict[str, FloatArray], step: int, rng_state: dict[str, Any],
                    config: dict[str, Any], history: dict[str, Any], *,
                    generator_states: dict[str, Any] | None = None) -> str:
    """Save a training state to ``path`` atomically.

    Parameters
    ----------
    path : str or os.PathLike
    params : dict of str to ndarray
        The model's flat ``params``.
    optimizer_state : dict of str to ndarray
        ``optimizer.state_dict()``.
    step : int
        Optimizer steps taken so far.
    rng_state : dict
        ``generator.bit_generator.state`` of the training-batch generator.
    config : dict
        JSON-serialisable configuration of the run.
    history : dict of str to sequence
        The run's history from step 1, keyed by ``HISTORY_FIELDS``:
        ``step`` (ints ``1 .. step``), ``loss``, ``accuracy``, ``lr`` (one
        number per step; ``accuracy`` may hold None), ``eval_step`` (ints,
        strictly increasing, within ``1 .. step``), ``eval_loss``,
        ``eval_accuracy`` (one number or None per evaluation).
        :func:`load_checkpoint` gives it back equal, None included.
    generator_states : dict of str to dict, optional
        ``{name: generator.bit_generator.state}`` of the run's other
        Generators: the model's own (``model.generators()``: the layers'
        dropout masks), and the text task's ``"sample"``.

    Returns
    -------
    str
        ``path``.

    Raises
    ------
    ValueError
        If ``step`` is not a non-negative int, or ``history`` lacks a key,
        has an unknown one, or does not fit ``step`` (the rules of
        :func:`load_checkpoint`); nothing is written then.
    TypeError
        If a ``history`` entry holds something other than numbers (and None
        for the values), or an array has dtype object.

    Examples
    --------
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "run.npz")
    >>> rng = np.random.default_rng(0)
    >>> history = {"step": [1, 2, 3], "loss": [0.9, 0.5, 0.4], "accuracy": [None] * 3,
    ...            "lr": [0.1] * 3, "eval_step": [3], "eval_loss": [0.45], "eval_accuracy": [None]}
    >>> _ = save_checkpoint(path, {"w": np.ones(2)}, {}, 3, rng.bit_generator.state, {"lr": 0.1},
    ...                     history)
    >>> ckpt = load_checkpoint(path)
    >>> ckpt.step, ckpt.config, ckpt.params["w"], ckpt.history == history
    (3, {'lr': 0.1}, array([1., 1.]), True)
    """
    step = check_int(step, "step", 0, expected="a non-negative int")
    history_arrays = _history_arrays(history)
    problem = _history_problem(history_arrays, int(step))
    if problem is not None:
        raise ValueError(f"history does not fit step={int(step)}: {problem}")
    arrays = {
        "meta/magic": np.array(MAGIC),
        "meta/format_version": np.array(FORMAT_VERSION, dtype=np.int64),
        "meta/step": np.array(int(step), dtype=np.int64),
        "meta/config": np.array(json.dumps(config, sort_keys=True)),
        "meta/rng_state": np.array(json.dumps(rng_state, sort_keys=True)),
    }
    if generator_states is not None:
        arrays[_GENERATORS] = np.array(json.dumps(generator_states, sort_keys=True))
    for name, value in params.items():
        arrays["param/" + name] = np.asarray(value)
    for name, value in optimizer_state.items():
        arrays["optim/" + name] = np.asarray(value)
    arrays.update(history_arrays)
    return write_npz_atomic(path, arrays)


def _history_arrays(history):
    """The ``history/<field>`` arrays of a history dict (None -> NaN), or TypeError/ValueError."""
    if not isinstance(history, dict):
        raise TypeError(f"history must be a dict keyed by {HISTORY_FIELDS}, "
                        f"got {type(history).__name__}")
    missing = [name for name in HISTORY_FIELDS if name not in history]
    unknown = sorted(set(history) - set(HISTORY_FIELDS), key=str)
    if missing or unknown:
        raise ValueError(f"history must have exactly the keys {HISTORY_FIELDS}; "
                         f"missing {missing}, unexpected {unknown}")
    arrays = {}
    for name in HISTORY_FIELDS:
        values = list(history[name])
        if name in _STEP_FIELDS:
            for value in values:
                if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                    raise TypeError(f"history[{name!r}] must hold ints, got {value!r}")
            arrays["history/" + name] = np.array(values, dtype=np.int64)
            continue
        # NOTE: None (no accuracy: the regression task) is stored as NaN and read back as None
        try:
            arrays["history/" + name] = np.array([np.nan if v is None else v for v in values],
                                                 dtype=np.float64)
        except (TypeError, ValueError):
            raise TypeError(f"history[{name!r}] must hold numbers or None, got "
                            f"{values[:3]!r}...") from None
    return arrays


def _history_layout_problem(specs, step):
    """What makes ``history/`` entries of these shapes and dtypes unfit for ``step``, or None.

    ``specs``: ``{field: array or ArraySpec}``; needs only ``shape`` and ``dtype``.
    """
    for name in HISTORY_FIELDS:
        shape, dtype = tuple(specs[name].shape), specs[name].dtype
        expected = np.dtype(np.int64 if name in _STEP_FIELDS else np.float64)
        if dtype != expected or len(shape) != 1:
            return (f"history/{name} must be a 1-D {expected} array, got dtype {dtype} "
                    f"shape {shape}")
    lengths = {name: specs[name].shape[0] for name in _PER_STEP}
    if set(lengths.values()) != {step}:
        return (f"history/step, loss, accuracy and lr must hold one entry per step taken "
                f"(meta/step = {step}), got lengths {lengths}")
    lengths = {name: specs[name].shape[0] for name in _PER_EVAL}
    if len(set(lengths.values())) != 1:
        return f"history/eval_step, eval_loss and eval_accuracy must have one length, got {lengths}"
    return None


def _history_problem(arrays, step):
    """What makes the ``history/`` arrays unfit for a checkpoint at ``step``, or None."""
    problem = _history_layout_problem({name: arrays["history/" + name] for name in HISTORY_FIELDS},
                                      step)
    if problem is not None:
        return problem
    steps = arrays["history/step"]
    wrong = np.flatnonzero(steps != np.arange(1, step + 1))
    if wrong.size:
        index = int(wrong[0])
        return (f"history/step must list every step 1, 2, ..., {step} in order, got "
                f"{int(steps[index])} at index {index}")
    eval_steps = arrays["history/eval_step"]
    previous = np.concatenate([[0], eval_steps])[:-1]  # the step before each, 0 before the first
    wrong = np.flatnonzero((eval_steps <= previous) | (eval_steps > step))
    if wrong.size:
        index = int(wrong[0])
        return (f"history/eval_step must increase strictly within 1..{step} (meta/step), got "
                f"{int(eval_steps[index])} at index {index}"
                + (f" after {int(previous[index])}" if index else ""))
    return None


def _history_lists(arrays):
    """The history dict of lists that :func:`_history_arrays` encoded (NaN -> None)."""
    history = {}
    for name in HISTORY_FIELDS:
        values = arrays["history/" + name].tolist()
        if name not in _STEP_FIELDS:
            values = [None if math.isnan(v) else v for v in values]
        history[name] = values
    return history


def _open_archive(path):
    """The zip archive at ``path``, opened, after the checks that need no parsing."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {path!r} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"{path!r} cannot be read ({exc.strerror})") from None
    if stat.S_ISDIR(mode):
        raise CheckpointError(f"{path!r} is a directory, not a checkpoint file")
    if not stat.S_ISREG(mode):
        # NOTE: a FIFO would block the read forever, a device could stream without end
        raise CheckpointError(f"{path!r} is not a regular file (a device, FIFO or socket)")
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as exc:
        raise CheckpointError(f"{path!r} cannot be read ({exc.strerror})") from None
    if head[:6] == b"\x93NUMPY":
        raise CheckpointError(f"{path!r} is a single-array .npy file, not a checkpoint .npz")
    if head[:4] != b"PK\x03\x04":
        raise CheckpointError(
            f"{path!r} is not an .npz archive (expected a zip file starting with b'PK\\x03\\x04', "
            f"got first bytes {head[:4]!r})"
        )
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(_corrupt(path, exc)) from None


def _corrupt(path, exc, name=None):
    where = "" if name is None else f" (entry {name!r})"
    return (f"{path!r} is truncated or corrupt and cannot be read as an .npz archive{where} "
            f"({type(exc).__name__}: {exc})")


def _read_headers(archive, path):
    """``{entry name: ArraySpec}`` from the zip directory and each ``.npy`` header.

    Reads a few hundred bytes per entry, never an entry's data. Refuses, naming
    the entry: a member that is not ``<name>.npy``, a repeated name, an
    unreadable header, an object (pickled) dtype, and a header whose shape and
    dtype do not account for exactly the bytes the zip directory lists.
    """
    headers = {}
    for info in archive.infolist():
        if not info.filename.endswith(".npy"):
            raise CheckpointError(f"{path!r}: unexpected member {info.filename!r} (entries are "
                                  "<name>.npy arrays)")
        name = info.filename[:-4]
        if name in headers:
            raise CheckpointError(f"{path!r}: entry {name!r} appears twice")
        try:
            with archive.open(info) as f:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    shape, _, dtype = np.lib.format.read_array_header_1_0(f)
                elif version == (2, 0):
                    shape, _, dtype = np.lib.format.read_array_header_2_0(f)
                else:
                    raise ValueError(f".npy format version {version} (qkvnp writes 1.0)")
                offset = f.tell()
        except (ValueError, TypeError, SyntaxError, EOFError, OSError, zipfile.BadZipFile,
                NotImplementedError) as exc:
            raise CheckpointError(_corrupt(path, exc, name)) from None
        if dtype.hasobject:
            raise CheckpointError(
                f"{path!r}: entry {name!r} holds pickled Python objects; checkpoints are "
                "loaded without pickle and this one is refused"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes != info.file_size:
            raise CheckpointError(
                f"{path!r}: entry {name!r} declares shape {shape} dtype {dtype} "
                f"({nbytes:,} bytes) but the archive holds {info.file_size - offset:,} bytes "
                "of data for it"
            )
        headers[name] = ArraySpec(tuple(shape), dtype)
    return headers


def _read_entry(archive, path, name):
    """Load one entry whose header was checked (so its size is known and bounded)."""
    try:
        with archive.open(name + ".npy") as f:
            return np.lib.format.read_array(f, allow_pickle=False)
    except (ValueError, EOFError, OSError, zipfile.BadZipFile, KeyError) as exc:
        raise CheckpointError(_corrupt(path, exc, name)) from None


def _check_meta_headers(headers, path):
    """The five ``meta/`` entries exist (and the optional one may), are scalars of their
    kind, and the texts are short."""
    missing = [name for name in _META if name not in headers]
    if missing and "meta" in headers:
        raise CheckpointError(f"{path!r} is a text checkpoint of an earlier qkvnp (one 'meta' "
                              "entry, without the sampling generator's state): train again "
                              "with train --task text to resume or read it")
    if missing:
        raise CheckpointError(f"{path!r} is not a qkvnp checkpoint: missing {missing}")
    for name in _META + ((_GENERATORS,) if _GENERATORS in headers else ()):
        spec = headers[name]
        integer = name in ("meta/format_version", "meta/step")
        if spec.shape != () or spec.dtype.kind not in ("iu" if integer else "U"):
            expected = "an integer scalar" if integer else "a unicode scalar"
            raise CheckpointError(f"{path!r}: {name} must be {expected}, got dtype {spec.dtype} "
                                  f"shape {spec.shape}")
        if not integer and spec.dtype.itemsize > 4 * MAX_TEXT:
            raise CheckpointError(f"{path!r}: {name} holds {spec.dtype.itemsize // 4:,} "
                                  f"characters, more than a checkpoint writes (<= {MAX_TEXT:,})")


def load_checkpoint(path: str | str | os.PathLike[str],
                    layout: Callable[..., Any] | None = None) -> Checkpoint:
    """Read and validate a checkpoint written by :func:`save_checkpoint`.

    Every entry's name, shape and dtype are checked from the archive's
    directory and the ``.npy`` headers before any array is loaded, so that a
    hostile file (a header declaring 10**12 elements, a compressed entry of
    gigabytes of zeros) costs a few kilobytes to refuse.

    Parameters
    ----------
    path : str or os.PathLike
    layout : callable, optional
        ``layout(config) -> (specs, max_step)``: given the stored
        configuration (a dict), the ``{"param/<name>" or "optim/<key>":
        (shape, dtype)}`` entries it implies and the largest step it allows.
        It raises ``ValueError`` or ``TypeError`` for a configuration it
        refuses (``qkvnp.training.loop.checkpoint_layout`` bounds every
        size), or a :class:`CheckpointError` whose message follows the
        file's name (``"is a checkpoint of train --task text, ..."``). Without it, any float ``param/`` and numeric ``optim/``
        entries are accepted.

    Returns
    -------
    Checkpoint
        ``params`` and ``optimizer_state`` (dicts of ndarray), ``step`` (int),
        ``rng_state`` and ``config`` (dicts), ``history`` (dict of lists, as
        given to :func:`save_checkpoint`), ``format_version`` (int), ``path``
        (str), ``generator_states`` (dict, ``{}`` when the file has none).

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    CheckpointError
        (a ``ValueError``) naming the file and the entry, if ``path`` is a
        directory or not a regular file, is not an ``.npz``, is truncated or
        corrupt, holds an object (pickled) array, lacks an entry, has an
        unknown entry, has an entry whose header does not match its size or
        what the configuration implies, is of another format version, holds a
        non-finite parameter or optimizer entry, or has a history that does
        not fit its step: ``history/step`` must be exactly ``1 .. step`` (so
        no longer than the step count, no gaps, no repeats),
        ``history/eval_step`` strictly increasing within ``1 .. step``, the
        arrays 1-D, int64 for the steps and float64 for the values, each
        group of one length. The history's values themselves are records and
        are not checked (NaN reads back as None).

    Notes
    -----
    A version 1 file (written before checkpoints stored the history) is
    refused rather than resumed with a history that would start at its step:
    the message says to train again from step 0 with the same settings,
    which, a run being a pure function of its settings, reaches the same
    state, with its history.
    """
    path = os.fspath(path)
    with _open_archive(path) as archive:
        headers = _read_headers(archive, path)
        _check_meta_headers(headers, path)
        meta = {name: _read_entry(archive, path, name) for name in _META}
        if str(meta["meta/magic"]) != MAGIC:
            raise CheckpointError(
                f"{path!r}: meta/magic must be {MAGIC!r}, got {str(meta['meta/magic'])[:80]!r}")
        version = int(meta["meta/format_version"])
        if version != FORMAT_VERSION:
            raise CheckpointError(_version_message(path, version))
        step = int(meta["meta/step"])
        if step < 0:
            raise CheckpointError(f"{path!r}: meta/step must be >= 0, got {step}")
        config = _json(meta["meta/config"], "meta/config", path)
        rng_state = _json(meta["meta/rng_state"], "meta/rng_state", path)
        generator_states = {}
        if _GENERATORS in headers:
            generator_states = _json(_read_entry(archive, path, _GENERATORS), _GENERATORS, path)
        _check_layout(headers, path, step, config, layout)
        arrays = {name: _read_entry(archive, path, name) for name in headers
                  if name not in _META and name != _GENERATORS}
    problem = _history_problem(arrays, step)
    if problem is not None:
        raise CheckpointError(f"{path!r}: {problem}")
    params = {name[6:]: value for name, value in arrays.items() if name.startswith("param/")}
    optimizer_state = {name[6:]: value for name, value in arrays.items()
                       if name.startswith("optim/")}
    for prefix, group in (("param/", params), ("optim/", optimizer_state)):
        for name, value in group.items():
            if not np.isfinite(value).all():
                index = np.unravel_index(np.flatnonzero(~np.isfinite(value))[0], value.shape)
                raise CheckpointError(
                    f"{path!r}: entry {prefix + name!r} holds {value[index]} at index "
                    f"{tuple(int(i) for i in index)}; a checkpoint holds finite numbers only"
                )
    return Checkpoint(params, optimizer_state, step, rng_state, config, _history_lists(arrays),
                      version, path, generator_states)


def _version_message(path, version):
    if version == 1:
        advice = (
            "version 1 checkpoints predate the stored loss history and cannot be resumed; "
            "train again from step 0 with the same settings and --save (a run is a pure "
            "function of its settings, so it reaches the same state, history included)"
        )
    elif version > FORMAT_VERSION:
        advice = "it was written by a newer qkvnp: resume it with that version"
    else:
        advice = "no qkvnp ever wrote that version"
    return (f"{path!r} has checkpoint format version {version}; this qkvnp reads "
            f"version {FORMAT_VERSION} only: {advice}")


def _check_layout(headers, path, step, config, layout):
    """Refuse, from the headers alone, any entry the checkpoint should not have."""
    missing = [name for name in _HISTORY if name not in headers]
    if missing:
        raise CheckpointError(f"{path!r}: missing history entries {missing}")
    unexpected = [name for name in headers if name not in _META and name not in _HISTORY
                  and name != _GENERATORS and not name.startswith(("param/", "optim/"))]
    if unexpected:
        raise CheckpointError(f"{path!r}: unexpected entry {unexpected[0]!r}")
    if layout is not None:
        try:
            specs, max_step = layout(config)
        except CheckpointError as exc:  # a sentence about the file: another task's, too large
            raise CheckpointError(f"{path!r} {exc}") from None
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{path!r} holds an invalid configuration (meta/config): "
                                  f"{exc}") from None
        if step > max_step:
            raise CheckpointError(f"{path!r}: meta/step is {step}, beyond the {max_step} steps "
                                  "of its configuration (meta/config)")
        for prefix, what in (("param/", "parameter"), ("optim/", "optimizer entry")):
            check_params_match(
                {name[6:]: spec for name, spec in headers.items() if name.startswith(prefix)},
                {name[6:]: ArraySpec(*spec) for name, spec in specs.items()
                 if name.startswith(prefix)},
                what, f"checkpoint {path!r}")
    else:
        for name, spec in headers.items():
            if name.startswith("param/") and spec.dtype.kind != "f":
                raise CheckpointError(f"{path!r}: parameter {name[6:]!r} must be a float array, "
                                      f"got dtype {spec.dtype}")
            if name.startswith("optim/") and spec.dtype.kind not in "biuf":
                raise CheckpointError(f"{path!r}: optimizer entry {name[6:]!r} must be numeric, "
                                      f"got dtype {spec.dtype}")
    problem = _history_layout_problem({name[8:]: headers[name] for name in _HISTORY}, step)
    if problem is not None:
        raise CheckpointError(f"{path!r}: {problem}")


def _json(value, name, path):
    """The JSON object held by the unicode scalar ``value`` (its header already checked)."""
    try:
        decoded = json.loads(str(value))
    except (json.JSONDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path!r}: {name} is not valid JSON ({exc})") from None
    if not isinstance(decoded, dict):
        raise CheckpointError(f"{path!r}: {name} must be a JSON object, got {type(decoded).__name__}")
    return decoded


def _spec(value):
    """The :class:`ArraySpec` of an array (or of an ``ArraySpec``)."""
    if not hasattr(value, "dtype"):
        value = np.asarray(value)
    return ArraySpec(tuple(value.shape), np.dtype(value.dtype))


def check_params_match(saved, expected, what="parameter", source="checkpoint"):
    """Refuse ``saved`` arrays unless names, shapes and dtypes equal ``expected``'s.

    Parameters
    ----------
    saved, expected : dict of str to ndarray or ArraySpec
    what : str
        Word used in the message ("parameter", "optimizer entry").
    source : str
        Where ``saved`` came from, for the message.

    Raises
    ------
    CheckpointError
        Listing every missing, unexpected or mismatched entry.
    """
    problems = []
    for name in sorted(set(expected) - set(saved)):
        problems.append(f"missing {what} {name!r}")
    for name in sorted(set(saved) - set(expected)):
        problems.append(f"unexpected {what} {name!r}")
    for name in sorted(set(saved) & set(expected)):
        got, want = _spec(saved[name]), _spec(expected[name])
        if got != want:
            problems.append(
                f"{what} {name!r}: expected shape {want.shape} dtype {want.dtype}, "
                f"got shape {got.shape} dtype {got.dtype}"
            )
    if problems:
        raise CheckpointError(
            f"{source} does not match this model: " + "; ".join(problems)
        )
