"""Atomic file writes: every file qkvnp writes (checkpoints, results, plots).

A reader never sees a half-written file, and a failed write leaves the old
file as it was: data goes to a temporary file beside the target, is flushed
and fsync'ed, then renamed over the target (``os.replace`` is atomic).

What "the target" is: a symlink is written through (the file it points to
is replaced, the link stays); a directory or a special file (a device, a
FIFO, a socket) is refused, never replaced. A new file's mode follows the
umask (0644 under the usual 022), a replaced file keeps its mode.
:func:`check_writable` runs the same checks, and creates and removes a
temporary file, so that a long job can find out before it starts.
"""
import contextlib
import os
import secrets
import stat

__all__ = ["atomic_write", "check_writable", "write_target"]


def write_target(path, what="path"):
    """The file that writing ``path`` replaces: ``path`` with its symlinks resolved.

    Parameters
    ----------
    path : str or os.PathLike
    what : str
        The argument's name, for the messages.

    Returns
    -------
    str
        An absolute path, an existing regular file or a name not yet taken.

    Raises
    ------
    ValueError
        If ``path`` is empty, or names (through its links) a directory or a
        special file.
    OSError
        If it cannot be examined (a symlink loop, a permission).
    """
    path = os.fspath(path)
    if path == "":
        raise ValueError(f"{what} is empty: give a file name")
    target = os.path.realpath(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return target
    if stat.S_ISDIR(mode):
        raise ValueError(f"{what} {path!r} is a directory: give a file name")
    if not stat.S_ISREG(mode):
        shown = path if target == os.path.abspath(path) else f"{path} -> {target}"
        raise ValueError(f"{what} {shown!r} is not a regular file (a device, FIFO or socket); "
                         "qkvnp writes regular files only")
    return target


def _shortened(directory, name, extra):
    """``name`` cut so that ``extra`` more bytes still fit the directory's longest file name.

    NOTE: a legal name near the limit (255 bytes on most file systems) must
    stay writable: its temporary file's name is the one that gets shorter.
    """
    try:
        name_max = os.pathconf(directory, "PC_NAME_MAX")
    except (AttributeError, OSError, ValueError):  # Windows, or a file system that cannot say
        name_max = 255
    if not name_max or name_max < 0:
        name_max = 255
    while name and len(os.fsencode(name)) + extra > name_max:
        name = name[:-1]  # by characters: a multi-byte character is never split
    return name


def _create_temporary(directory, name):
    """Create a new, empty, private-name file in ``directory``; return ``(fd, path)``.

    ``os.open`` with mode 0o666 lets the kernel apply the umask, as ``open()``
    does for a new file (``tempfile.mkstemp`` would give 0600).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) \
        | getattr(os, "O_BINARY", 0)
    name = _shortened(directory, name, len(".") + len(".tmp") + 8)
    for _ in range(100):
        tmp_path = os.path.join(directory, f".{name}.tmp{secrets.token_hex(4)}")
        try:
            return os.open(tmp_path, flags, 0o666), tmp_path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {directory!r}")


def check_writable(path, what="path"):
    """Refuse now a ``path`` that :func:`atomic_write` could not write later.

    Checks what can be known before writing: ``path`` is not empty, not a
    directory or special file (through its symlinks), its directory exists,
    and a file can be created (and is removed) there. A full disk is only
    found by writing.

    Parameters
    ----------
    path : str or os.PathLike
    what : str
        The argument's name, for the messages.

    Returns
    -------
    str
        The file that will be replaced (:func:`write_target`).

    Raises
    ------
    ValueError
        Empty, a directory, or a special file.
    FileNotFoundError
        The directory does not exist.
    PermissionError, OSError
        No file can be created in the directory (read-only, full inode table).
    """
    target = write_target(path, what)
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{what}: directory {directory!r} does not exist")
    try:
        fd, tmp_path = _create_temporary(directory, os.path.basename(target))
    except OSError as exc:
        raise type(exc)(exc.errno, f"{what}: cannot create a file in {directory!r} "
                                   f"({exc.strerror})") from None
    os.close(fd)
    os.unlink(tmp_path)
    return target


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """Open a temporary file that replaces ``path`` when the block succeeds.

    Parameters
    ----------
    path : str or os.PathLike
        The file to (re)write. Its directory must exist. A symlink is written
        through: the file it points to is replaced and the link stays.
    mode : {"wb", "w"}
        Binary or text.

    Yields
    ------
    file object
        Write to it inside the ``with`` block; on an exception the temporary
        file is removed, ``path`` is untouched and the exception propagates.

    Raises
    ------
    ValueError
        If ``path`` is empty, a directory or a special file (see
        :func:`write_target`); nothing is created then.

    Notes
    -----
    A new file gets mode ``0o666 & ~umask``; an existing file keeps its mode.

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
    target = write_target(path)
    directory = os.path.dirname(target)
    fd, tmp_path = _create_temporary(directory, os.path.basename(target))
    try:
        with os.fdopen(fd, mode) as f:
            with contextlib.suppress(FileNotFoundError):  # a replaced file keeps its mode
                os.chmod(tmp_path, stat.S_IMODE(os.stat(target).st_mode))
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, target)
    except BaseException:
        with contextlib.suppress(OSError):
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
