"""Atomic file writes: every file qkvnp writes (checkpoints, results, plots).

A reader never sees a half-written file, and a failed write leaves the old
file as it was: data goes to a temporary file beside the target, is flushed
and fsync'ed, then renamed over the target (``os.replace`` is atomic).
"""
import contextlib
import os
import tempfile

__all__ = ["atomic_write"]


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """Open a temporary file that replaces ``path`` when the block succeeds.

    Parameters
    ----------
    path : str or os.PathLike
        The file to (re)write. Its directory must exist.
    mode : {"wb", "w"}
        Binary or text.

    Yields
    ------
    file object
        Write to it inside the ``with`` block; on an exception the temporary
        file is removed, ``path`` is untouched and the exception propagates.

    Examples
    --------
    >>> import json, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "result.json")
    >>> with atomic_write(path, "w") as f:
    ...     json.dump({"ok": True}, f)
    >>> open(path).read()
    '{"ok": true}'
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"mode must be 'wb' or 'w', got {mode!r}")
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp_path = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory):
    """Make the rename durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
