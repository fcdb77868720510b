"""Training checkpoints: one ``.npz`` archive, written atomically, read without pickle.

A checkpoint holds everything a run needs to continue as if it had never
stopped: the parameters, the optimizer's state, the step, the state of the
generator that draws the training batches, and the run's configuration.

Layout of the archive (every entry a plain numeric or unicode array)::

    meta/magic           "qkvnp-checkpoint"
    meta/format_version  int64, FORMAT_VERSION
    meta/step            int64, optimizer steps taken
    meta/config          JSON text of the configuration
    meta/rng_state       JSON text of ``Generator.bit_generator.state``
    param/<name>         one array per model parameter
    optim/<key>          one array per entry of ``optimizer.state_dict()``

Writing goes to a temporary file in the destination's directory, which is
flushed, fsync'ed and renamed over the destination (``os.replace``), so that a
crash leaves either the old file or the new one, never half of one. Reading
uses ``np.load(..., allow_pickle=False)`` and refuses anything unexpected
(not a zip archive, truncated, an object array, a missing or unknown entry,
another format version) with a :class:`CheckpointError` naming the problem.
"""
import json
import os
import zipfile
from collections import namedtuple

import numpy as np

from ._io import atomic_write

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "Checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "check_params_match",
    "write_npz_atomic",
]

FORMAT_VERSION = 1
MAGIC = "qkvnp-checkpoint"
_META = ("meta/magic", "meta/format_version", "meta/step", "meta/config", "meta/rng_state")

Checkpoint = namedtuple("Checkpoint", "params optimizer_state step rng_state config format_version")


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


def save_checkpoint(path, params, optimizer_state, step, rng_state, config):
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

    Returns
    -------
    str
        ``path``.

    Examples
    --------
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "run.npz")
    >>> rng = np.random.default_rng(0)
    >>> _ = save_checkpoint(path, {"w": np.ones(2)}, {}, 3, rng.bit_generator.state, {"lr": 0.1})
    >>> ckpt = load_checkpoint(path)
    >>> ckpt.step, ckpt.config, ckpt.params["w"]
    (3, {'lr': 0.1}, array([1., 1.]))
    """
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    arrays = {
        "meta/magic": np.array(MAGIC),
        "meta/format_version": np.array(FORMAT_VERSION, dtype=np.int64),
        "meta/step": np.array(int(step), dtype=np.int64),
        "meta/config": np.array(json.dumps(config, sort_keys=True)),
        "meta/rng_state": np.array(json.dumps(rng_state, sort_keys=True)),
    }
    for name, value in params.items():
        arrays["param/" + name] = np.asarray(value)
    for name, value in optimizer_state.items():
        arrays["optim/" + name] = np.asarray(value)
    return write_npz_atomic(path, arrays)


def _read_all(path):
    """Every entry of the ``.npz`` at ``path`` as a dict, or CheckpointError."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    with open(path, "rb") as f:
        head = f.read(6)
    if head[:6] == b"\x93NUMPY":
        raise CheckpointError(f"{path!r} is a single-array .npy file, not a checkpoint .npz")
    if head[:4] != b"PK\x03\x04":
        raise CheckpointError(
            f"{path!r} is not an .npz archive (expected a zip file starting with b'PK\\x03\\x04', "
            f"got first bytes {head[:4]!r})"
        )
    arrays = {}
    try:
        with np.load(path, allow_pickle=False) as data:
            for name in data.files:
                try:
                    arrays[name] = data[name]
                except ValueError as exc:
                    if "allow_pickle" in str(exc) or "Object arrays" in str(exc):
                        raise CheckpointError(
                            f"{path!r}: entry {name!r} holds pickled Python objects; "
                            "checkpoints are loaded without pickle and this one is refused"
                        ) from None
                    raise
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"{path!r} is truncated or corrupt and cannot be read as an .npz archive "
            f"({type(exc).__name__}: {exc})"
        ) from None
    return arrays


def load_checkpoint(path):
    """Read and validate a checkpoint written by :func:`save_checkpoint`.

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    Checkpoint
        ``params`` and ``optimizer_state`` (dicts of ndarray), ``step`` (int),
        ``rng_state`` and ``config`` (dicts), ``format_version`` (int).

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    CheckpointError
        (a ``ValueError``) if the file is not an ``.npz``, is truncated or
        corrupt, holds an object (pickled) array, lacks an entry, has an
        unknown entry, or is of another format version.
    """
    arrays = _read_all(path)
    missing = [name for name in _META if name not in arrays]
    if missing:
        raise CheckpointError(f"{os.fspath(path)!r} is not a qkvnp checkpoint: missing {missing}")
    if str(arrays["meta/magic"]) != MAGIC:
        raise CheckpointError(
            f"{os.fspath(path)!r}: meta/magic must be {MAGIC!r}, got {str(arrays['meta/magic'])!r}"
        )
    version = _int_scalar(arrays["meta/format_version"], "meta/format_version", path)
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{os.fspath(path)!r} has checkpoint format version {version}; this qkvnp reads "
            f"version {FORMAT_VERSION}"
        )
    step = _int_scalar(arrays["meta/step"], "meta/step", path)
    if step < 0:
        raise CheckpointError(f"{os.fspath(path)!r}: meta/step must be >= 0, got {step}")
    config = _json(arrays["meta/config"], "meta/config", path)
    rng_state = _json(arrays["meta/rng_state"], "meta/rng_state", path)
    params, optimizer_state = {}, {}
    for name, value in arrays.items():
        if name.startswith("param/"):
            if value.dtype.kind != "f":
                raise CheckpointError(
                    f"{os.fspath(path)!r}: parameter {name[6:]!r} must be a float array, "
                    f"got dtype {value.dtype}"
                )
            params[name[6:]] = value
        elif name.startswith("optim/"):
            if value.dtype.kind not in "biuf":
                raise CheckpointError(
                    f"{os.fspath(path)!r}: optimizer entry {name[6:]!r} must be numeric, "
                    f"got dtype {value.dtype}"
                )
            optimizer_state[name[6:]] = value
        elif name not in _META:
            raise CheckpointError(f"{os.fspath(path)!r}: unexpected entry {name!r}")
    return Checkpoint(params, optimizer_state, step, rng_state, config, version)


def _int_scalar(value, name, path):
    if value.shape != () or value.dtype.kind not in "iu":
        raise CheckpointError(
            f"{os.fspath(path)!r}: {name} must be an integer scalar, got dtype {value.dtype} "
            f"shape {value.shape}"
        )
    return int(value)


def _json(value, name, path):
    if value.shape != () or value.dtype.kind != "U":
        raise CheckpointError(
            f"{os.fspath(path)!r}: {name} must be a unicode scalar holding JSON, got dtype "
            f"{value.dtype} shape {value.shape}"
        )
    try:
        decoded = json.loads(str(value))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{os.fspath(path)!r}: {name} is not valid JSON ({exc})") from None
    if not isinstance(decoded, dict):
        raise CheckpointError(
            f"{os.fspath(path)!r}: {name} must be a JSON object, got {type(decoded).__name__}"
        )
    return decoded


def check_params_match(saved, expected, what="parameter", source="checkpoint"):
    """Refuse ``saved`` arrays unless names, shapes and dtypes equal ``expected``'s.

    Parameters
    ----------
    saved, expected : dict of str to ndarray
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
        got, want = np.asarray(saved[name]), np.asarray(expected[name])
        if got.shape != want.shape or got.dtype != want.dtype:
            problems.append(
                f"{what} {name!r}: expected shape {want.shape} dtype {want.dtype}, "
                f"got shape {got.shape} dtype {got.dtype}"
            )
    if problems:
        raise CheckpointError(
            f"{source} does not match this model: " + "; ".join(problems)
        )
