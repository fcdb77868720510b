"""Checkpoints: round trip, bitwise resume, Ctrl-C, and every refusal.

Oracles: a saved-then-loaded array is ``np.array_equal`` to the original (with
its dtype); an interrupted-then-resumed run ends with parameters
``np.array_equal`` to those of a run that never stopped (same seed, same
configuration); a refused file leaves every file on disk byte-for-byte as it was.
"""
import json
import os
import signal

import numpy as np
import pytest

from qkvnp.checkpoint import (CheckpointError, load_checkpoint, save_checkpoint,
                              write_npz_atomic)
from qkvnp.cli import main
from qkvnp.train import TrainConfig, train

TINY = dict(num_keys=8, num_values=8, num_pairs=4, dim=8, batch_size=16, eval_size=32)


def tiny(**changes):
    return TrainConfig(**{**TINY, "steps": 30, **changes})


def interrupt_at(step):
    """A train() callback that presses Ctrl-C (a real SIGINT) after ``step``."""
    def callback(info):
        if info["step"] == step:
            signal.raise_signal(signal.SIGINT)
    return callback


def assert_same_params(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert np.array_equal(a[name], b[name]), f"{name} differs"


@pytest.fixture
def saved(tmp_path):
    """A real checkpoint of a tiny kv-recall run at step 10, and its path."""
    path = tmp_path / "run.npz"
    train(tiny(steps=10), save=path)
    return path


# ---------------------------------------------------------------- round trip


def test_round_trip_preserves_arrays_dtypes_config_and_generator(tmp_path):
    # oracle: exact equality of everything written
    rng = np.random.default_rng(7)
    rng.random(5)
    params = {"a.W": rng.standard_normal((3, 2)), "b": rng.standard_normal(4).astype(np.float32)}
    state = {"step": np.array(5, dtype=np.int64), "exp_avg/a.W": np.ones((3, 2))}
    config = {"lr": 0.1, "task": "kv-recall", "nested": [1, 2]}
    path = save_checkpoint(tmp_path / "c.npz", params, state, 12, rng.bit_generator.state, config)
    ckpt = load_checkpoint(path)
    assert ckpt.step == 12 and ckpt.config == config and ckpt.format_version == 1
    assert_same_params(ckpt.params, params)
    assert_same_params(ckpt.optimizer_state, state)
    restored = np.random.default_rng()
    restored.bit_generator.state = ckpt.rng_state
    assert np.array_equal(restored.random(10), rng.random(10))


def test_checkpoint_of_a_run_holds_params_optimizer_step_and_config(saved):
    ckpt = load_checkpoint(saved)
    assert ckpt.step == 10
    assert "attention.W_query" in ckpt.params and "embed_key.weight" in ckpt.params
    assert "exp_avg/attention.W_query" in ckpt.optimizer_state
    assert int(ckpt.optimizer_state["step"]) == 10
    assert ckpt.config["task"] == "kv-recall" and ckpt.config["steps"] == 10


def test_write_is_atomic_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    # oracle: a failure while writing leaves the old file intact and no *.tmp*
    path = tmp_path / "c.npz"
    write_npz_atomic(path, {"x": np.arange(3.0)})
    before = path.read_bytes()

    def broken_savez(file, **arrays):
        file.write(b"PK\x03\x04 half an archive")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", broken_savez)
    with pytest.raises(OSError, match="disk full"):
        write_npz_atomic(path, {"x": np.arange(4.0)})
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["c.npz"]


def test_object_arrays_are_never_written(tmp_path):
    with pytest.raises(TypeError, match="dtype object"):
        write_npz_atomic(tmp_path / "c.npz", {"x": np.array([1, None], dtype=object)})
    assert not os.listdir(tmp_path)


# ---------------------------------------------------------------- bitwise resume


@pytest.mark.parametrize("task", [
    "kv-recall",  # embeddings, tied-free attention, Adam + cosine schedule
    "teacher",  # MultiHeadAttention student, MSE
])
def test_interrupted_and_resumed_run_is_bitwise_identical(tmp_path, task):
    # oracle: the uninterrupted run with the same configuration
    config = tiny(task=task, steps=24, embed_dim=8, seq_len=4)
    straight = train(config)
    path = tmp_path / "ckpt.npz"
    stopped = train(config, save=path, callback=interrupt_at(9))
    assert stopped.interrupted and stopped.step == 9 and stopped.checkpoint == os.fspath(path)
    assert load_checkpoint(path).step == 9
    resumed = train(config, resume=path)
    assert resumed.step == 24 and not resumed.interrupted
    assert len(resumed.history["loss"]) == 15  # 24 - 9 more steps
    assert_same_params(resumed.model.params, straight.model.params)
    assert_same_params(resumed.optimizer.state_dict(), straight.optimizer.state_dict())
    assert resumed.history["loss"] == straight.history["loss"][9:]


def test_steps_counts_the_total_across_resumes(tmp_path):
    # oracle: with a constant learning rate, 10 steps then 20 more equal 30 steps
    path = tmp_path / "ckpt.npz"
    first = train(tiny(steps=10, schedule="constant"), save=path)
    assert first.step == 10
    resumed = train(tiny(steps=30, schedule="constant"), resume=path, save=path)
    assert resumed.step == 30 and len(resumed.history["step"]) == 20
    assert resumed.history["step"][0] == 11
    straight = train(tiny(steps=30, schedule="constant"))
    assert_same_params(resumed.model.params, straight.model.params)
    assert load_checkpoint(path).step == 30


def test_ctrl_c_without_save_writes_the_default_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = train(tiny(steps=20), callback=interrupt_at(5))
    assert result.interrupted and result.step == 5
    assert result.checkpoint == os.path.join(os.fspath(tmp_path), "qkvnp-kv-recall-step5.npz")
    assert load_checkpoint(result.checkpoint).step == 5


def test_cli_ctrl_c_saves_and_exits_130(tmp_path, monkeypatch, capsys):
    import qkvnp.train as train_module

    class PressCtrlC(train_module.Progress):
        def __call__(self, info):
            super().__call__(info)
            if info["step"] == 7:
                signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(train_module, "Progress", PressCtrlC)
    path = tmp_path / "run.npz"
    argv = ["train", "--steps", "40", "--num-keys", "8", "--num-values", "8", "--num-pairs", "4",
            "--dim", "8", "--eval-size", "32", "--save", str(path)]
    assert main(argv) == 130
    out = capsys.readouterr().out
    assert "stopped at step 7/40" in out and "--resume" in out
    assert load_checkpoint(path).step == 7
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    # and the command line resumes it to the end
    assert main(["train", "--resume", str(path), "--save", str(path), "--quiet"]) == 0
    assert load_checkpoint(path).step == 40


# ---------------------------------------------------------------- refusals


def _refused(path, match, capsys):
    """Both the library and the CLI refuse ``path``; no file is touched."""
    before = {name: (path.parent / name).read_bytes() for name in os.listdir(path.parent)}
    with pytest.raises((CheckpointError, FileNotFoundError), match=match):
        train(tiny(steps=40), resume=path, save=path)
    assert main(["train", "--resume", str(path), "--save", str(path), "--steps", "40"]) == 2
    err = capsys.readouterr().err
    assert "nothing was trained or written" in err
    after = {name: (path.parent / name).read_bytes() for name in os.listdir(path.parent)}
    assert after == before  # nothing overwritten, nothing new
    return err


def test_refuses_a_truncated_file(saved, capsys):
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) // 2])
    _refused(saved, "truncated or corrupt", capsys)


def test_refuses_a_file_that_is_not_an_npz(tmp_path, capsys):
    path = tmp_path / "notes.npz"
    path.write_text("these are my notes, not a checkpoint\n")
    err = _refused(path, "not an .npz archive", capsys)
    assert "not an .npz archive" in err


def test_refuses_an_npy_file(tmp_path, capsys):
    path = tmp_path / "array.npz"
    with open(path, "wb") as f:
        np.save(f, np.ones(3))
    _refused(path, "single-array .npy", capsys)


def test_refuses_a_missing_file(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train(tiny(), resume=tmp_path / "nope.npz")
    assert main(["train", "--resume", str(tmp_path / "nope.npz")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("key", [
    "optim/exp_avg/readout.b",  # a real optimizer entry replaced by objects
    "param/readout.b",  # a parameter
    "meta/config",  # the metadata
    "extra",  # an entry nobody asked for
])
def test_refuses_a_pickled_object_array_under_any_key(saved, capsys, key):
    with np.load(saved, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    arrays[key] = np.array([{"evil": "pickle"}, None], dtype=object)
    with open(saved, "wb") as f:
        np.savez(f, **arrays)  # plain savez pickles the object array
    _refused(saved, "pickled Python objects", capsys)


def test_refuses_another_models_configuration(saved, capsys):
    # a checkpoint of dim=8 resumed by a run asking dim=16 (the CLI's --dim)
    with pytest.raises(CheckpointError, match="dim: checkpoint 8, this run 16"):
        train(tiny(steps=40, dim=16), resume=saved)
    before = saved.read_bytes()
    assert main(["train", "--resume", str(saved), "--dim", "16", "--save", str(saved)]) == 2
    assert "another configuration" in capsys.readouterr().err
    assert saved.read_bytes() == before


def test_refuses_another_dtype(saved, capsys):
    before = saved.read_bytes()
    assert main(["train", "--resume", str(saved), "--dtype", "float32", "--save", str(saved)]) == 2
    assert "dtype: checkpoint 'float64', this run 'float32'" in capsys.readouterr().err
    assert saved.read_bytes() == before


def _rewrite(path, change):
    with np.load(path, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    change(arrays)
    write_npz_atomic(path, arrays)


def test_refuses_parameters_of_another_shape(saved, capsys):
    def grow(arrays):
        arrays["param/readout.W"] = np.zeros((8, 9))
    _rewrite(saved, grow)
    err = _refused(saved, r"parameter 'readout.W': expected shape \(8, 8\)", capsys)
    assert "got shape (8, 9)" in err


def test_refuses_parameters_of_another_dtype(saved, capsys):
    def shrink(arrays):
        arrays["param/query_marker"] = arrays["param/query_marker"].astype(np.float32)
    _rewrite(saved, shrink)
    _refused(saved, "dtype float64, got shape .* dtype float32", capsys)


def test_refuses_missing_and_unexpected_parameters(saved, capsys):
    def rename(arrays):
        arrays["param/attention.W_qk"] = arrays.pop("param/attention.W_query")
    _rewrite(saved, rename)
    _refused(saved, "missing parameter 'attention.W_query'; unexpected parameter 'attention.W_qk'",
             capsys)


def test_refuses_another_format_version_and_bad_metadata(saved, capsys):
    original = load_checkpoint(saved).config

    def future(arrays):
        arrays["meta/format_version"] = np.array(99, dtype=np.int64)
    _rewrite(saved, future)
    _refused(saved, "format version 99", capsys)

    def garbled(arrays):
        arrays["meta/format_version"] = np.array(1, dtype=np.int64)
        arrays["meta/config"] = np.array("{not json")
    _rewrite(saved, garbled)
    _refused(saved, "meta/config is not valid JSON", capsys)

    def unknown_setting(arrays):
        arrays["meta/config"] = np.array(json.dumps({**original, "flux_capacitor": 1}))
    _rewrite(saved, unknown_setting)
    with pytest.raises(CheckpointError, match="invalid configuration.*flux_capacitor"):
        train(tiny(steps=40), resume=saved)


def test_refuses_a_checkpoint_beyond_the_requested_steps(saved):
    with pytest.raises(CheckpointError, match="beyond steps=5"):
        train(tiny(steps=5), resume=saved)


def test_save_into_a_missing_directory_fails_before_training(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train(tiny(), save=tmp_path / "no" / "such" / "dir.npz")


def test_a_second_ctrl_c_aborts_without_saving(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def press_twice(info):
        if info["step"] == 3:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        train(tiny(steps=20), save=tmp_path / "run.npz", callback=press_twice)
    assert not os.listdir(tmp_path)  # nothing written
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert "Ctrl-C: stopping after this step" in capsys.readouterr().err
