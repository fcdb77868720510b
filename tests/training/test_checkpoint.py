"""Checkpoints: round trip, bitwise resume, Ctrl-C, and every refusal.

Oracles: a saved-then-loaded array is ``np.array_equal`` to the original (with
its dtype), a saved-then-loaded history ``==`` to the original; an
interrupted-then-resumed run ends with parameters ``np.array_equal`` to those
of a run that never stopped (same seed, same configuration), and with a
history ``==`` to its history; a refused file leaves every file on disk
byte-for-byte as it was.
"""
import json
import os
import signal

import numpy as np
import pytest

from qkvnp.training.checkpoint import (FORMAT_VERSION, CheckpointError, load_checkpoint,
                              save_checkpoint, write_npz_atomic)
from qkvnp.apps.cli import main
from qkvnp.training.loop import TrainConfig, train

TINY = dict(num_keys=8, num_values=8, num_pairs=4, dim=8, batch_size=16, eval_size=32)


def tiny(**changes):
    return TrainConfig(**{**TINY, "steps": 30, **changes})


def interrupt_at(step):
    """A train() callback that presses Ctrl-C (a real SIGINT) after ``step``."""
    def callback(info):
        if info["step"] == step:
            signal.raise_signal(signal.SIGINT)
    return callback


def history_of(steps, eval_steps=()):
    """A valid history of ``steps`` steps, with random values, evaluated at ``eval_steps``."""
    rng = np.random.default_rng(steps)
    return {"step": list(range(1, steps + 1)), "loss": rng.random(steps).tolist(),
            "accuracy": rng.random(steps).tolist(), "lr": rng.random(steps).tolist(),
            "eval_step": list(eval_steps), "eval_loss": rng.random(len(eval_steps)).tolist(),
            "eval_accuracy": rng.random(len(eval_steps)).tolist()}


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
    history = history_of(12, eval_steps=[5, 10, 12])
    history["accuracy"][3] = None  # None (no accuracy) survives the trip
    history["eval_accuracy"] = [None] * 3
    path = save_checkpoint(tmp_path / "c.npz", params, state, 12, rng.bit_generator.state, config,
                           history)
    ckpt = load_checkpoint(path)
    assert ckpt.step == 12 and ckpt.config == config and ckpt.format_version == FORMAT_VERSION == 2
    assert ckpt.history == history
    assert type(ckpt.history["step"][0]) is int and type(ckpt.history["loss"][0]) is float
    assert_same_params(ckpt.params, params)
    assert_same_params(ckpt.optimizer_state, state)
    restored = np.random.default_rng()
    restored.bit_generator.state = ckpt.rng_state
    assert np.array_equal(restored.random(10), rng.random(10))


def test_checkpoint_of_a_run_holds_params_optimizer_step_config_and_history(saved):
    ckpt = load_checkpoint(saved)
    assert ckpt.step == 10
    assert "attention.W_query" in ckpt.params and "embed_key.weight" in ckpt.params
    assert "exp_avg/attention.W_query" in ckpt.optimizer_state
    assert int(ckpt.optimizer_state["step"]) == 10
    assert ckpt.config["task"] == "kv-recall" and ckpt.config["steps"] == 10
    # oracle: the same run's in-memory history (a run is a function of its configuration)
    assert ckpt.history == train(tiny(steps=10)).history
    with np.load(saved, allow_pickle=False) as data:  # plain numeric arrays in the archive
        assert data["history/step"].dtype == np.int64 and data["history/loss"].dtype == np.float64


def test_history_of_a_run_without_accuracy_round_trips_as_none(tmp_path):
    # the teacher task has no accuracy: None in memory, NaN in the file, None again
    path = tmp_path / "teacher.npz"
    result = train(tiny(task="teacher", steps=4, embed_dim=8, seq_len=4), save=path)
    assert result.history["accuracy"] == [None] * 4
    assert load_checkpoint(path).history == result.history
    with np.load(path, allow_pickle=False) as data:
        assert np.isnan(data["history/accuracy"]).all()


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


@pytest.mark.parametrize("task, dropout", [
    ("kv-recall", 0.0),  # embeddings, tied-free attention, Adam + cosine schedule
    ("partner", 0.0),  # the same model; the pairing is rebuilt from the seed on resume
    ("teacher", 0.0),  # MultiHeadAttention student, MSE
    ("kv-recall", 0.3),  # dropout: the model's own Generator is saved and restored
    ("partner", 0.3),  # dropout on partner: the same model's Generator
    ("teacher", 0.3),  # dropout: the layer's own Generator is saved and restored
])
def test_interrupted_and_resumed_run_is_bitwise_identical(tmp_path, task, dropout):
    # oracle: the uninterrupted run with the same configuration
    config = tiny(task=task, steps=24, embed_dim=8, seq_len=4, dropout=dropout)
    straight = train(config)
    if dropout:  # the masks change the run (else this case would test nothing new)
        assert straight.history["loss"] != train(tiny(task=task, steps=24, embed_dim=8,
                                                      seq_len=4)).history["loss"]
    path = tmp_path / "ckpt.npz"
    stopped = train(config, save=path, callback=interrupt_at(9))
    assert stopped.interrupted and stopped.step == 9 and stopped.checkpoint == os.fspath(path)
    assert load_checkpoint(path).step == 9
    assert load_checkpoint(path).history["loss"] == straight.history["loss"][:9]
    # stopped twice: the second checkpoint carries the first session's history on
    again = train(config, resume=path, save=path, callback=interrupt_at(17))
    assert again.interrupted and again.start_step == 9 and again.step == 17
    resumed = train(config, resume=path)
    assert resumed.step == 24 and resumed.start_step == 17 and not resumed.interrupted
    assert_same_params(resumed.model.params, straight.model.params)
    assert_same_params(resumed.optimizer.state_dict(), straight.optimizer.state_dict())
    assert resumed.history["step"] == list(range(1, 25))  # the whole run, not 18..24
    assert resumed.history == straight.history  # every step's loss, accuracy, lr; every evaluation


def test_steps_counts_the_total_across_resumes(tmp_path):
    # oracle: with a constant learning rate, 10 steps then 20 more equal 30 steps
    path = tmp_path / "ckpt.npz"
    first = train(tiny(steps=10, schedule="constant"), save=path)
    assert first.step == 10
    resumed = train(tiny(steps=30, schedule="constant"), resume=path, save=path)
    assert resumed.step == 30 and resumed.start_step == 10
    straight = train(tiny(steps=30, schedule="constant"))
    assert_same_params(resumed.model.params, straight.model.params)
    for key in ("step", "loss", "accuracy", "lr"):  # one entry per step, the first 10 included
        assert resumed.history[key] == straight.history[key], key
    # eval_every is steps // 10: every step in the first session, every 3rd in the second
    assert resumed.history["eval_step"] == [*range(1, 11), *range(12, 31, 3)]
    assert load_checkpoint(path).step == 30
    assert load_checkpoint(path).history == resumed.history


def test_ctrl_c_without_save_writes_the_default_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = train(tiny(steps=20), callback=interrupt_at(5))
    assert result.interrupted and result.step == 5
    assert result.checkpoint == os.path.join(os.fspath(tmp_path), "qkvnp-kv-recall-step5.npz")
    assert load_checkpoint(result.checkpoint).step == 5


def test_cli_ctrl_c_saves_and_exits_130(tmp_path, monkeypatch, capsys):
    import qkvnp.training.report as report_module

    # NOTE: the handler before the run, not default_int_handler: a test run
    # started in the background of a shell inherits SIGINT ignored (SIG_IGN)
    before = signal.getsignal(signal.SIGINT)

    class PressCtrlC(report_module.Progress):
        def __call__(self, info):
            super().__call__(info)
            if info["step"] == 7:
                signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(report_module, "Progress", PressCtrlC)
    path = tmp_path / "run.npz"
    argv = ["train", "--steps", "40", "--num-keys", "8", "--num-values", "8", "--num-pairs", "4",
            "--dim", "8", "--eval-size", "32", "--save", str(path)]
    assert main(argv) == 130
    out = capsys.readouterr().out
    assert "stopped at step 7/40" in out and "--resume" in out
    assert load_checkpoint(path).step == 7
    assert signal.getsignal(signal.SIGINT) is before  # handler restored
    # and the command line resumes it to the end; the summary's speed counts this session
    assert main(["train", "--resume", str(path), "--save", str(path), "--quiet"]) == 0
    assert "done at step 40/40: 33 steps in" in capsys.readouterr().out
    assert load_checkpoint(path).step == 40
    assert load_checkpoint(path).history["step"] == list(range(1, 41))


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
    _refused(saved, "format version 99; this qkvnp reads version 2 only: .* newer qkvnp", capsys)

    def garbled(arrays):
        arrays["meta/format_version"] = np.array(FORMAT_VERSION, dtype=np.int64)
        arrays["meta/config"] = np.array("{not json")
    _rewrite(saved, garbled)
    _refused(saved, "meta/config is not valid JSON", capsys)

    def unknown_setting(arrays):
        arrays["meta/config"] = np.array(json.dumps({**original, "flux_capacitor": 1}))
    _rewrite(saved, unknown_setting)
    with pytest.raises(CheckpointError, match="invalid configuration.*flux_capacitor"):
        train(tiny(steps=40), resume=saved)


def test_refuses_a_version_1_checkpoint_and_says_to_train_again(saved, capsys):
    # a file as the previous format wrote it: no history/ entries, version 1
    def version_1(arrays):
        for name in [name for name in arrays if name.startswith("history/")]:
            del arrays[name]
        arrays["meta/format_version"] = np.array(1, dtype=np.int64)
    _rewrite(saved, version_1)
    err = _refused(saved, "format version 1; .* train again from step 0 with the same settings",
                   capsys)
    assert "predate the stored loss history" in err


def _history_change(change):
    """An archive edit applying ``change(history)`` to the ``history/`` arrays of a checkpoint."""
    def edit(arrays):
        history = {name[8:]: arrays[name] for name in list(arrays) if name.startswith("history/")}
        change(history)
        for name in [name for name in arrays if name.startswith("history/")]:
            del arrays[name]
        arrays.update({"history/" + name: value for name, value in history.items()})
    return edit


def _longer(history):
    for name in ("step", "loss", "accuracy", "lr"):
        history[name] = np.append(history[name], history[name][-1:])
    history["step"][-1] = 11


def _swap(name, i, j):
    def change(history):
        history[name][[i, j]] = history[name][[j, i]]
    return change


def _set(name, value):
    def change(history):
        history[name] = value(history[name])
    return change


@pytest.mark.parametrize("change, match", [
    # one more step recorded than meta/step = 10 says were taken
    (_longer, r"one entry per step taken \(meta/step = 10\), got lengths"),
    # a step missing from the per-step values
    (_set("loss", lambda loss: loss[:-1]), r"got lengths \{'step': 10, 'loss': 9"),
    # steps out of order
    (_swap("step", 2, 3), r"every step 1, 2, ..., 10 in order, got 4 at index 2"),
    # a step counted twice (same length: 1, 2, 2, 4, ...)
    (_set("step", lambda step: np.where(step == 3, 2, step)), "got 2 at index 2"),
    # the values in float32: would not read back equal to the run's float64 values
    (_set("loss", lambda loss: loss.astype(np.float32)),
     "history/loss must be a 1-D float64 array, got dtype float32 shape"),
    # steps written as floats
    (_set("step", lambda step: step.astype(np.float64)),
     "history/step must be a 1-D int64 array, got dtype float64"),
    # text instead of numbers
    (_set("lr", lambda lr: lr.astype(str)), "history/lr must be a 1-D float64 array, got dtype <U"),
    # 2-D
    (_set("accuracy", lambda accuracy: accuracy.reshape(2, 5)),
     r"history/accuracy must be a 1-D float64 array, got dtype float64 shape \(2, 5\)"),
    # evaluations out of order, repeated, at step 0, after the last step
    (_swap("eval_step", 4, 5), "eval_step must increase strictly within 1..10 .* got 5 at index 5 "
                               "after 6"),
    (_set("eval_step", lambda steps: np.where(steps == 4, 3, steps)), "got 3 at index 3 after 3"),
    (_set("eval_step", lambda steps: steps - 1), "within 1..10 .* got 0 at index 0$"),
    (_set("eval_step", lambda steps: steps + 1), "within 1..10 .* got 11 at index 9"),
    # evaluation arrays of different lengths
    (_set("eval_loss", lambda loss: loss[:-1]), "eval_step, eval_loss and eval_accuracy must have "
                                                "one length"),
    # an entry missing, an entry nobody knows
    (lambda history: history.pop("lr"), r"missing history entries \['history/lr'\]"),
    (lambda history: history.update(grad_norm=np.ones(10)),
     "unexpected entry 'history/grad_norm'"),
])
def test_refuses_a_history_that_does_not_fit_the_step(saved, capsys, change, match):
    assert load_checkpoint(saved).history["eval_step"] == list(range(1, 11))  # eval_every 1
    _rewrite(saved, _history_change(change))
    _refused(saved, match, capsys)


@pytest.mark.parametrize("change, error, match", [
    (lambda history: history["step"].append(4), ValueError, "one entry per step taken"),
    (lambda history: history.pop("eval_loss"), ValueError, r"missing \['eval_loss'\]"),
    (lambda history: history.update(extra=[]), ValueError, r"unexpected \['extra'\]"),
    (lambda history: history["step"].__setitem__(0, 1.0), TypeError, "must hold ints, got 1.0"),
    (lambda history: history["eval_step"].__setitem__(0, None), TypeError, "must hold ints"),
    (lambda history: history["loss"].__setitem__(0, "low"), TypeError, "numbers or None"),
    (lambda history: history["eval_step"].reverse(), ValueError, "increase strictly"),
])
def test_save_refuses_a_history_it_could_not_read_back(tmp_path, change, error, match):
    history = history_of(3, eval_steps=[1, 3])
    change(history)
    rng = np.random.default_rng(0)
    with pytest.raises(error, match=match):
        save_checkpoint(tmp_path / "c.npz", {"w": np.ones(2)}, {}, 3, rng.bit_generator.state,
                        {}, history)
    assert not os.listdir(tmp_path)  # nothing written


def test_refuses_a_checkpoint_beyond_the_requested_steps(saved):
    with pytest.raises(CheckpointError, match="beyond steps=5"):
        train(tiny(steps=5), resume=saved)


def test_save_into_a_missing_directory_fails_before_training(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train(tiny(), save=tmp_path / "no" / "such" / "dir.npz")


def test_a_second_ctrl_c_aborts_without_saving(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN in a background shell job

    def press_twice(info):
        if info["step"] == 3:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        train(tiny(steps=20), save=tmp_path / "run.npz", callback=press_twice)
    assert not os.listdir(tmp_path)  # nothing written
    assert signal.getsignal(signal.SIGINT) is before
    assert "Ctrl-C: stopping after this step" in capsys.readouterr().err
