"""Saving never loses a run: --save checked before the first step, symlinks written
through, modes from the umask, a failed write reported in one line with the old file
intact, and --save-every checkpoints that resume bitwise.

Oracles: exit codes and the one-line messages; ``os.lstat``/``os.stat`` of the
files (link kept, mode bits); the bytes of the old file; the directory listing
(no temporary left); a run that never stopped, compared with ``np.array_equal``
and ``==`` on the history; that no step ran (no callback call, no summary).
"""
import errno
import os
import stat
import sys

import numpy as np
import pytest

import qkvnp._io as io_module
from qkvnp._io import atomic_write, check_writable
from qkvnp.apps.cli import main
from qkvnp.training.checkpoint import load_checkpoint
from qkvnp.training.loop import SaveError, TrainConfig, train

TINY = dict(num_keys=8, num_values=8, num_pairs=4, dim=8, batch_size=16, eval_size=32)
TINY_ARGS = ["--num-keys", "8", "--num-values", "8", "--num-pairs", "4", "--dim", "8",
             "--batch-size", "16", "--eval-size", "32", "--quiet"]


def usage_error(argv, capsys):
    """``main(argv)`` refuses before training: exit 2, the train usage, one ``error:`` line."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # not even the run's description: nothing was built
    assert captured.err.startswith("usage: ") and " train " in captured.err.splitlines()[0]
    last = captured.err.splitlines()[-1]
    assert " train: error: " in last and "Traceback" not in captured.err
    return last


def never_called(info):
    raise AssertionError(f"a step ran: {info}")


def listing(*directories):
    return sorted(name for directory in directories for name in os.listdir(directory))


# ---------------------------------------------------------------- checked before the first step


def test_empty_save_is_refused_up_front(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "--save is empty" in usage_error(["train", "--save", "", *TINY_ARGS], capsys)
    with pytest.raises(ValueError, match="save is empty"):
        train(TrainConfig(**TINY, steps=5), save="", callback=never_called)
    assert os.listdir(tmp_path) == []


def test_a_directory_as_the_target_is_refused_up_front(tmp_path, capsys):
    target = tmp_path / "out"
    target.mkdir()
    assert "is a directory" in usage_error(["train", "--save", str(target), *TINY_ARGS], capsys)
    with pytest.raises(ValueError, match="is a directory"):
        train(TrainConfig(**TINY, steps=5), save=target, callback=never_called)
    assert listing(tmp_path) == ["out"] and listing(target) == []


def test_a_special_file_is_never_replaced(tmp_path, capsys):
    # a FIFO: any user can make one (the issue's /dev/full copy is a device: below)
    fifo = tmp_path / "pipe.npz"
    os.mkfifo(fifo)
    assert "not a regular file" in usage_error(["train", "--save", str(fifo), *TINY_ARGS], capsys)
    with pytest.raises(ValueError, match="not a regular file"):
        train(TrainConfig(**TINY, steps=5), save=fifo, callback=never_called)
    with pytest.raises(ValueError, match="not a regular file"):
        with atomic_write(fifo) as f:
            f.write(b"x")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and listing(tmp_path) == ["pipe.npz"]


def test_a_device_node_and_a_link_to_dev_null_are_never_replaced(tmp_path, capsys):
    device = tmp_path / "full.npz"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 7))  # a copy of /dev/full
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot make a device node here ({exc})")
    link = tmp_path / "null.npz"
    link.symlink_to("/dev/null")
    for path in (device, link):
        message = usage_error(["train", "--save", str(path), *TINY_ARGS], capsys)
        assert "not a regular file" in message
    assert stat.S_ISCHR(os.lstat(device).st_mode) and os.path.islink(link)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_read_only_directory_is_refused_up_front(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories (see the os.open test below)")
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        message = usage_error(["train", "--save", str(folder / "run.npz"), *TINY_ARGS], capsys)
    finally:
        folder.chmod(0o755)
    assert "cannot create a file in" in message and "Permission denied" in message


def test_a_directory_where_no_file_can_be_created_is_refused_up_front(tmp_path, capsys,
                                                                      monkeypatch):
    # the same refusal for any user: creating a file there fails as a read-only one would
    folder = tmp_path / "ro"
    folder.mkdir()
    real_open = os.open

    def read_only_open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and os.path.dirname(os.fspath(path)) == os.fspath(folder):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(io_module.os, "open", read_only_open)
    message = usage_error(["train", "--save", str(folder / "run.npz"), *TINY_ARGS], capsys)
    assert f"--save: cannot create a file in {str(folder)!r} (Permission denied)" in message
    with pytest.raises(PermissionError, match="save: cannot create a file in"):
        train(TrainConfig(**TINY, steps=5), save=folder / "run.npz", callback=never_called)


def test_check_writable_leaves_nothing_behind(tmp_path):
    assert check_writable(tmp_path / "run.npz") == os.path.join(os.path.realpath(tmp_path),
                                                                "run.npz")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", [
    "a" * 246 + ".npz",  # 250 bytes
    "a" * 251 + ".npz",  # 255 bytes: the longest legal name on most file systems
    "é" * 123 + ".npz",  # 250 bytes in UTF-8, 127 characters
], ids=["250-bytes", "255-bytes", "250-bytes-utf8"])
def test_a_legal_long_name_is_saved(tmp_path, capsys, name):
    # oracle: the file system's limit on one name (NAME_MAX); was "File name too long",
    # because the temporary file's name added 13 bytes
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    if len(os.fsencode(name)) > limit:
        pytest.skip(f"this file system's names are at most {limit} bytes")
    path = tmp_path / name
    assert main(["train", "--steps", "3", "--save", str(path), *TINY_ARGS]) == 0, \
        capsys.readouterr().err
    assert load_checkpoint(path).step == 3
    assert os.listdir(tmp_path) == [name]  # and no temporary file left


# ---------------------------------------------------------------- what is written


def test_a_symlink_is_written_through(tmp_path):
    # the issue: link.npz -> real/target.npz became a regular file, the target kept its content
    real = tmp_path / "real"
    real.mkdir()
    target = real / "target.npz"
    target.write_bytes(b"old content")
    link = tmp_path / "link.npz"
    link.symlink_to(target)
    train(TrainConfig(**TINY, steps=5), save=link)
    assert os.path.islink(link) and os.readlink(link) == os.fspath(target)
    assert load_checkpoint(target).step == 5  # the target holds the new checkpoint
    assert listing(tmp_path) == ["link.npz", "real"] and listing(real) == ["target.npz"]


def test_a_relative_and_dangling_symlink_is_written_through(tmp_path):
    (tmp_path / "real").mkdir()
    link = tmp_path / "link.npz"
    link.symlink_to("real/new.npz")  # relative, and the target does not exist yet
    train(TrainConfig(**TINY, steps=3), save=link)
    assert os.path.islink(link) and load_checkpoint(tmp_path / "real" / "new.npz").step == 3


@pytest.fixture
def umask():
    """Set the process umask for one test (``umask(0o022)``), and restore it."""
    previous = os.umask(0o022)
    os.umask(previous)
    yield lambda mask: os.umask(mask)
    os.umask(previous)


@pytest.mark.parametrize("mask, mode", [
    (0o022, 0o644),  # the usual umask (was 0600: mkstemp's private mode)
    (0o027, 0o640),
    (0o077, 0o600),
])
def test_new_checkpoints_and_plots_follow_the_umask(tmp_path, umask, mask, mode, monkeypatch):
    umask(mask)
    path = tmp_path / "run.npz"
    result = train(TrainConfig(**TINY, steps=3), save=path)
    assert stat.S_IMODE(os.stat(path).st_mode) == mode
    # a plot goes through the same writer (matplotlib is optional: a stand-in writes bytes)
    from qkvnp.training.report import plot_run
    import types
    from unittest import mock

    class Figure(mock.MagicMock):
        def subplots(self, *args, **kwargs):
            return mock.MagicMock(), mock.MagicMock()

        def savefig(self, file, format, dpi):
            file.write(b"\x89PNG stand-in")

    figure_module = types.ModuleType("matplotlib.figure")
    figure_module.Figure = Figure
    monkeypatch.setitem(sys.modules, "matplotlib", types.ModuleType("matplotlib"))
    monkeypatch.setitem(sys.modules, "matplotlib.figure", figure_module)
    assert plot_run(result, tmp_path / "out.png", stream=open(os.devnull, "w")) is True
    assert stat.S_IMODE(os.stat(tmp_path / "out.png").st_mode) == mode


def test_a_replaced_file_keeps_its_mode(tmp_path, umask):
    umask(0o022)
    path = tmp_path / "run.npz"
    path.write_bytes(b"old")
    path.chmod(0o600)  # the user made it private
    train(TrainConfig(**TINY, steps=3), save=path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


# ---------------------------------------------------------------- a write that fails


def full_disk(monkeypatch):
    """Every fsync fails with ENOSPC, as on a full disk (data buffered, nowhere to go)."""
    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(io_module.os, "fsync", fsync)


def test_a_full_disk_at_the_final_write_is_one_line_and_keeps_the_old_file(tmp_path, capsys,
                                                                           monkeypatch):
    path = tmp_path / "run.npz"
    train(TrainConfig(**TINY, steps=5), save=path)
    before = path.read_bytes()
    full_disk(monkeypatch)
    assert main(["train", "--steps", "8", "--save", str(path), *TINY_ARGS]) == 1
    captured = capsys.readouterr()
    errors = captured.err.splitlines()
    assert errors == [f"error: could not write the checkpoint of step 8 to {str(path)!r}: the "
                      "disk is full; the file there is as it was"], captured.err
    assert "done at step" not in captured.out  # no summary claiming a saved run
    assert path.read_bytes() == before
    assert listing(tmp_path) == ["run.npz"]  # no temporary file left
    with pytest.raises(SaveError, match="disk is full"):
        train(TrainConfig(**TINY, steps=5), save=path)
    assert path.read_bytes() == before and listing(tmp_path) == ["run.npz"]


def test_a_failed_plot_write_is_one_line(tmp_path, capsys, monkeypatch):
    import types
    from unittest import mock

    class Figure(mock.MagicMock):
        def subplots(self, *args, **kwargs):
            return mock.MagicMock(), mock.MagicMock()

        def savefig(self, file, format, dpi):
            file.write(b"\x89PNG stand-in")

    figure_module = types.ModuleType("matplotlib.figure")
    figure_module.Figure = Figure
    monkeypatch.setitem(sys.modules, "matplotlib", types.ModuleType("matplotlib"))
    monkeypatch.setitem(sys.modules, "matplotlib.figure", figure_module)
    full_disk(monkeypatch)
    code = main(["train", "--steps", "3", "--plot", str(tmp_path / "out.png"), *TINY_ARGS])
    assert code == 1
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: --plot: could not write")
    assert listing(tmp_path) == []


# ---------------------------------------------------------------- --save-every


class Killed(Exception):
    """Stands for SIGKILL: the run ends at once, nothing runs after it (no final save)."""


def kill_at(step):
    def callback(info):
        if info["step"] == step:
            raise Killed
    return callback


@pytest.mark.parametrize("task", ["kv-recall", "teacher"])
def test_save_every_loses_at_most_n_steps_and_resumes_bitwise(tmp_path, task):
    # oracle: the run that never stopped, same configuration
    config = TrainConfig(**TINY, task=task, steps=24, embed_dim=8, seq_len=4, eval_every=4)
    straight = train(config)
    path = tmp_path / "run.npz"
    with pytest.raises(Killed):
        train(config, save=path, save_every=5, callback=kill_at(13))
    checkpoint = load_checkpoint(path)
    assert checkpoint.step == 10  # the last multiple of 5 before the kill: 3 steps lost
    assert checkpoint.history["loss"] == straight.history["loss"][:10]
    assert listing(tmp_path) == ["run.npz"]  # written atomically: no temporary left
    resumed = train(config, resume=path, save=path, save_every=5)
    assert resumed.start_step == 10 and resumed.step == 24
    for name, value in straight.model.params.items():
        assert np.array_equal(resumed.model.params[name], value), name
    for name, value in straight.optimizer.state_dict().items():
        assert np.array_equal(resumed.optimizer.state_dict()[name], value), name
    assert resumed.history == straight.history
    assert load_checkpoint(path).step == 24


def test_cli_save_every(tmp_path, capsys, monkeypatch):
    import qkvnp.training.report as report_module

    class KillAt7(report_module.Progress):
        def __call__(self, info):
            if info["step"] == 7:
                raise Killed
    monkeypatch.setattr(report_module, "Progress", KillAt7)
    path = tmp_path / "run.npz"
    argv = ["train", "--steps", "20", "--save", str(path), "--save-every", "3",
            *[a for a in TINY_ARGS if a != "--quiet"]]
    with pytest.raises(Killed):
        main(argv)
    assert load_checkpoint(path).step == 6
    capsys.readouterr()
    assert main(["train", "--resume", str(path), "--save", str(path), "--quiet"]) == 0
    assert "done at step 20/20: 14 steps in" in capsys.readouterr().out
    assert usage_error(["train", "--save", str(path), "--save-every", "0", *TINY_ARGS],
                       capsys).endswith("--save-every must be >= 1, got 0")
    with pytest.raises(ValueError, match="save_every needs save"):
        train(TrainConfig(**TINY, steps=5), save_every=2)
