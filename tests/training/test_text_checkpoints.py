"""``train --task text`` checkpoints, resume, preflight and divergence, as the other tasks have them.

Oracles: the uninterrupted run (a resume given only ``--resume`` prints the
same lines, samples included, and ends with the same history and parameters);
the kv-recall task's rules for ``--save`` and ``--save-every``, Ctrl-C and
divergence (checked before the first step: no ``step`` line printed; a step
checkpoint at the default path; exit status 1 with "training diverged"); the
original file for the checkpoint reader (every damaged file is one
``CheckpointError`` naming it and the entry, or reads back equal).
"""
import io
import json
import os
import signal
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

from qkvnp.apps.cli import main
from text_task_args import CORPUS, cli_args
from qkvnp.training import text as text_task
from qkvnp.training.checkpoint import CheckpointError, write_npz_atomic

# NOTE: settings other than the defaults, so that a resume that took the defaults would differ
SETTINGS = dict(steps=6, context=8, emb_dim=8, num_heads=2, num_layers=1, dropout=0.1,
                batch_size=3, lr=0.01, warmup=2, weight_decay=0.05, seed=3, eval_every=2,
                eval_windows=4, sample_every=2, sample_length=10)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def finished(runs, corpus):
    """The model and printed lines of the uninterrupted run."""
    code = main(["train", "--task", "text", "--text", corpus] + cli_args(SETTINGS))
    assert code == 0
    return runs[-1]


@pytest.fixture
def runs(monkeypatch, capsys):
    """Every ``train_text`` call's ``(model, rows, code)`` and printed lines, in order."""
    results, train_text = [], text_task.train_text

    def recording(*args, **kwargs):
        result = train_text(*args, **kwargs)
        results.append(result + (_progress_lines(capsys.readouterr().out),))
        return result

    monkeypatch.setattr(text_task, "train_text", recording)
    return results


def _progress_lines(out):
    return [line for line in out.splitlines() if line.startswith(("step ", "sample at step"))]


def _step_of(line):
    return int(line.split()[1] if line.startswith("step ") else line.split()[3].rstrip(":"))


def _stopped_at(corpus, tmp_path, step):
    """A checkpoint of the run stopped after ``step`` (as SIGTERM then would)."""
    part = str(tmp_path / "part.npz")
    config = text_task.TextConfig(text=corpus, **SETTINGS)
    text_task.train_text(config, save=part, stop_at=step, stream=io.StringIO())
    return part


def test_a_resume_given_only_resume_is_the_uninterrupted_run_bit_for_bit(corpus, tmp_path,
                                                                          finished, runs):
    # oracle: the run that never stopped: its lines after step 3 (the losses, the held-out
    # loss at step 4 that averages steps 3 and 4, the samples at 4 and 6 drawn by the
    # checkpointed sampling generator), its history rows and its parameters
    model, rows, _, lines = finished
    part = _stopped_at(corpus, tmp_path, 3)
    assert main(["train", "--task", "text", "--resume", part]) == 0
    _check_resumed_from_step_3(runs[-1], model, rows, lines)


def _check_resumed_from_step_3(resumed_run, model, rows, lines):
    """A run resumed after step 3 printed the uninterrupted run's later lines, its rows
    and its final parameters, bit for bit."""
    resumed, resumed_rows, code, resumed_lines = resumed_run
    assert code == 0
    assert resumed_lines == [line for line in lines if _step_of(line) > 3]
    assert any(line.startswith("sample at step 4") for line in resumed_lines)
    assert resumed_rows == rows
    assert sorted(resumed.params) == sorted(model.params)
    for name, value in model.params.items():
        np.testing.assert_array_equal(resumed.params[name], value, err_msg=name)


# NOTE: a Decoder has no dropout: the family run's settings are the GPT's without it
FAMILY_SETTINGS = {**{k: v for k, v in SETTINGS.items() if k != "dropout"}, "family": "qwen3",
                   "kv_heads": 1}


def test_a_family_resume_given_only_resume_is_the_uninterrupted_run_bit_for_bit(corpus,
                                                                                 tmp_path, runs):
    # oracle: as for the GPT above, the run of a qwen3 Decoder that never stopped
    assert main(["train", "--task", "text", "--text", corpus] + cli_args(FAMILY_SETTINGS)) == 0
    model, rows, _, lines = runs[-1]
    part = str(tmp_path / "part.npz")
    text_task.train_text(text_task.TextConfig(text=corpus, **FAMILY_SETTINGS), save=part,
                         stop_at=3, stream=io.StringIO())
    assert main(["train", "--task", "text", "--resume", part]) == 0
    _check_resumed_from_step_3(runs[-1], model, rows, lines)
    assert type(runs[-1][0]).__name__ == "Decoder"


def test_a_resume_refuses_an_explicit_other_lr_naming_it(corpus, tmp_path, capsys):
    # oracle: the kv-recall task's rule: a setting given on the command line that differs
    # from the checkpoint's is refused by name before any step; the same value is accepted
    part = _stopped_at(corpus, tmp_path, 3)
    assert main(["train", "--task", "text", "--resume", part, "--lr", "0.02"]) == 2
    captured = capsys.readouterr()
    assert "--lr" in captured.err and "0.02" in captured.err and "0.01" in captured.err
    assert "step" not in captured.out
    assert main(["train", "--task", "text", "--resume", part, "--lr", "0.01"]) == 0


@pytest.mark.parametrize("target", [
    "directory",       # the tmp directory itself
    "missing",         # in a directory that does not exist
    "empty",           # --save ""
    "/dev/null",       # a device
])
def test_save_is_checked_before_the_first_step(corpus, tmp_path, capsys, target):
    # oracle: the kv-recall task's preflight: a usage error and no step line printed
    save = {"directory": str(tmp_path), "missing": str(tmp_path / "no" / "run.npz"),
            "empty": ""}.get(target, target)
    if target == "/dev/null" and not os.path.exists("/dev/null"):
        pytest.skip("no /dev/null")
    code = main(["train", "--task", "text", "--text", corpus, "--save", save] + cli_args(SETTINGS))
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert "--save" in captured.err
    assert "step" not in captured.out


@pytest.mark.parametrize("options, message", [
    (["--save-every", "2"], "--save-every needs --save"),         # nothing to write to
    (["--save-every", "0", "--save", "run.npz"], "--save-every must be >= 1, got 0"),
    (["--save-every", "-3", "--save", "run.npz"], "--save-every must be >= 1, got -3"),
])
def test_save_every_is_refused_as_for_the_other_tasks(corpus, tmp_path, capsys, monkeypatch,
                                                     options, message):
    # oracle: the kv-recall task's messages for the same options (one rule for both)
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--task", "text", "--text", corpus] + cli_args(SETTINGS) + options)
    captured = capsys.readouterr()
    assert code == 2 and message in captured.err
    assert "step" not in captured.out
    assert main(["train"] + options) == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or sys.platform == "win32",
                    reason="POSIX signals")
def test_ctrl_c_without_save_writes_a_step_checkpoint_as_kv_recall_does(corpus, tmp_path):
    # oracle: the kv-recall task: Ctrl-C without --save writes qkvnp-<task>-step<N>.npz in
    # the working directory, says how to resume, and exits 130
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    settings = dict(SETTINGS, steps=1_000_000, eval_every=1, sample_every=1_000_000)
    process = subprocess.Popen(
        [sys.executable, "-m", "qkvnp", "train", "--task", "text", "--text", corpus]
        + cli_args(settings), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=str(tmp_path), env=env)
    for line in process.stdout:
        if line.startswith("step"):
            break
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    written = [name for name in os.listdir(tmp_path) if name.startswith("qkvnp-text-step")]
    assert len(written) == 1, (os.listdir(tmp_path), err)
    _, saved = text_task.load_text_checkpoint(str(tmp_path / written[0]))
    assert written[0] == f"qkvnp-text-step{saved.step}.npz" and saved.step >= 1
    assert f"--resume {tmp_path / written[0]}" in out


@pytest.mark.parametrize("lr", [
    1e38,   # the weights become inf: "contains NaN or inf" from the next forward
    1e30,   # the weights stay finite, a projection overflows float32
])
def test_a_diverging_text_run_is_a_training_divergence_not_a_usage_error(corpus, capsys, lr):
    # oracle: the kv-recall task's divergence: one "error: training diverged" line, status 1
    settings = dict(SETTINGS, lr=lr, dtype="float32")
    code = main(["train", "--task", "text", "--text", corpus] + cli_args(settings))
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.startswith("error: training diverged at step") and "usage:" not in err
    assert "lower the learning rate" in err


# ---------------------------------------------------------------- the reader


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A valid checkpoint of a tiny run, its bytes, and its model."""
    directory = tmp_path_factory.mktemp("saved")
    corpus = directory / "text.txt"
    corpus.write_bytes(CORPUS)
    path = str(directory / "run.npz")
    config = text_task.TextConfig(text=str(corpus), **dict(SETTINGS, steps=2))
    text_task.train_text(config, save=path, stream=io.StringIO())
    with open(path, "rb") as f:
        data = f.read()
    return path, data, text_task.load_text_checkpoint(path)[0]


def _entries(path):
    with np.load(path, allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def _with_json(entries, name, change):
    value = json.loads(str(entries[name]))
    change(value)
    return dict(entries, **{name: np.array(json.dumps(value))})


def _huge(config):
    config.update(emb_dim=8192, num_heads=2, num_layers=2)  # about 1.3e9 parameters


DAMAGES = {  # name -> (change of the entries, what the message must name)
    "meta/config is not an object": (
        lambda e: dict(e, **{"meta/config": np.array("[1, 2]")}), "meta/config"),
    "an unknown config key": (
        lambda e: _with_json(e, "meta/config", lambda c: c.update(bogus=1)), "meta/config.*bogus"),
    "a string-valued config key": (
        lambda e: _with_json(e, "meta/config", lambda c: c.update(emb_dim="8")),
        "meta/config.*--emb-dim must be an int"),
    "no sampling generator state": (
        lambda e: _with_json(e, "meta/generator_states", lambda g: g.pop("sample")),
        "meta/generator_states.*'sample'"),
    "a malformed generator state": (
        lambda e: _with_json(e, "meta/generator_states",
                             lambda g: g.update(sample={"bit_generator": "PCG64", "state": 1})),
        "meta/generator_states.*'sample'"),
    "a malformed batch generator state": (
        lambda e: dict(e, **{"meta/rng_state": np.array('{"state": "x"}')}), "meta/rng_state"),
    "complex parameters": (
        lambda e: dict(e, **{"param/out_head.W": e["param/out_head.W"].astype(np.complex64)}),
        "out_head.W.*complex64"),
    "a huge model in a small file": (
        lambda e: {name: value for name, value in
                   _with_json(e, "meta/config", _huge).items()
                   if not name.startswith(("param/", "optim/"))},
        "meta/config.*need at least"),
}


@pytest.mark.parametrize("damage", ["truncated"] + list(DAMAGES))
def test_a_damaged_or_hostile_text_checkpoint_is_one_checkpoint_error(saved, tmp_path, capsys,
                                                                      damage):
    # oracle: one CheckpointError naming the file and the entry (from the library), and one
    # "error:" line without a traceback (from generate), before any model is built
    path, data, _ = saved
    bad = str(tmp_path / "bad.npz")
    if damage == "truncated":
        with open(bad, "wb") as f:
            f.write(data[:len(data) // 2])
        entry = "truncated"
    else:
        change, entry = DAMAGES[damage]
        write_npz_atomic(bad, change(_entries(path)))
    with pytest.raises(CheckpointError, match=entry) as caught:
        text_task.load_text_checkpoint(bad)
    assert repr(bad) in str(caught.value)
    assert main(["generate", "--resume", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --resume:") and "Traceback" not in err and bad in err


def _meta_ranges(data, path):
    """The byte ranges of the ``meta/`` members (their local headers and data)."""
    with zipfile.ZipFile(path) as archive:
        return [(info.header_offset, info.header_offset + 30 + len(info.filename)
                 + len(info.extra) + info.compress_size)
                for info in archive.infolist() if info.filename.startswith("meta/")]


def _read_or_refuse(path, original):
    """Load ``path``: a CheckpointError, or a model equal to ``original`` (else the test fails)."""
    try:
        model, _ = text_task.load_text_checkpoint(path)
    except CheckpointError:
        return "refused"
    assert sorted(model.params) == sorted(original.params)
    for name, value in original.params.items():
        np.testing.assert_array_equal(model.params[name], value, err_msg=name)
    return "equal"


def test_the_text_checkpoint_reader_survives_truncations_and_byte_flips(saved, tmp_path):
    # oracle: the original file: every damaged copy reads back equal or is one CheckpointError
    path, data, original = saved
    bad = str(tmp_path / "damaged.npz")
    started = time.perf_counter()

    def outcome(case):
        with open(bad, "wb") as f:
            f.write(case)
        return _read_or_refuse(bad, original)

    # every truncation, the empty file included, is refused
    assert [outcome(data[:len(data) * i // 16]) for i in range(16)] == ["refused"] * 16
    rng = np.random.default_rng(0)
    ranges = _meta_ranges(data, path)
    assert len(ranges) == 6, ranges  # magic, version, step, config, rng_state, generator_states
    for _ in range(200):
        start, stop = ranges[rng.integers(len(ranges))]
        flipped = bytearray(data)
        flipped[int(rng.integers(start, stop))] ^= int(rng.integers(1, 256))
        outcome(bytes(flipped))
    assert time.perf_counter() - started < 60  # no case hangs


def test_another_tasks_checkpoint_is_named_for_what_it_is(corpus, tmp_path, capsys):
    # oracle: the file's own meta/config: a kv-recall checkpoint given to generate (and a text
    # checkpoint given to the kv-recall task) is one message saying which task wrote it
    from qkvnp.training import TrainConfig, train

    kv = str(tmp_path / "kv.npz")
    train(TrainConfig(steps=2, num_keys=8, num_values=8, num_pairs=4, dim=8, eval_size=16),
          save=kv)
    assert main(["generate", "--resume", kv, "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert f"{kv!r} is a checkpoint of train --task kv-recall, not a text checkpoint" in err
    text = str(tmp_path / "text.npz")
    assert main(["train", "--task", "text", "--text", corpus, "--save", text]
                + cli_args(dict(SETTINGS, steps=1))) == 0
    capsys.readouterr()
    assert main(["train", "--resume", text]) == 2
    assert f"{text!r} is a checkpoint of train --task text" in capsys.readouterr().err
