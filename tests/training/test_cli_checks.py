"""The train command refuses bad input before it trains; SIGTERM saves; --version.

Oracles: argparse's own behaviour (the sub-command's usage on stderr, a last line
``<prog> train: error: ...``, exit status 2) and that nothing was built or
trained (no description line, no summary on stdout); the order of the printed
lines; the checkpoint a signal leaves (its step) and a run that never stopped
(``np.array_equal``); the package's ``__version__``.
"""
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

import qkvnp
from qkvnp.apps.cli import main
from qkvnp.training.checkpoint import load_checkpoint
from qkvnp.training.loop import TrainConfig, train

TINY_ARGS = ["--num-keys", "8", "--num-values", "8", "--num-pairs", "4", "--dim", "8",
             "--batch-size", "16", "--eval-size", "32", "--quiet"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def usage_error(argv, capsys):
    """The last stderr line of a refusal before training (exit 2, the train usage)."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "", captured.out  # not even the run's description
    lines = captured.err.splitlines()
    assert lines[0].startswith("usage: ") and " train " in lines[0], captured.err
    assert " train: error: " in lines[-1] and "Traceback" not in captured.err
    return lines[-1].split(" train: error: ", 1)[1]


@pytest.mark.parametrize("argv, message", [
    # the five tracebacks
    (["--num-keys", "4", "--num-pairs", "5"], "--num-pairs must be <= --num-keys=4"),
    (["--optimizer", "sgd", "--momentum", "-1"], "--momentum must be >= 0, got -1.0"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0, got -1.0"),
    (["--task", "teacher", "--embed-dim", "16", "--num-heads", "3"],
     "--num-heads must divide --embed-dim=16, got --num-heads=3"),
    # the options that do not apply
    (["--num-heads", "4"], "--num-heads applies to --task teacher only (this run's task is "
                           "kv-recall)"),
    (["--momentum", "0.5"], "--momentum applies to --optimizer sgd only (this run uses adam)"),
    (["--optimizer", "adamw", "--momentum", "0.5"], "this run uses adamw"),
    (["--task", "teacher", "--variant", "shared"], "--variant applies to --task kv-recall and partner "
                                                  "only"),
    (["--task", "teacher", "--num-keys", "8", "--dim", "8"], "--num-keys, --dim apply to --task "
                                                             "kv-recall and partner only"),
    (["--task", "partner", "--num-keys", "7", "--num-pairs", "4"],
     "--num-keys must be even for partner (every key needs a partner)"),
    (["--task", "partner", "--num-pairs", "1"], "--num-pairs must be >= 2 for partner"),
    (["--steps", "10", "--warmup", "20"], "--warmup 20 is longer than the run (--steps 10)"),
    (["--warmup", "20"], "--warmup 20 is longer than the run (--steps 10)"),  # TINY's steps below
    (["--schedule", "constant", "--warmup", "5"], "--warmup applies to --schedule cosine only"),
    # values out of range
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--steps", "100000000"], "--steps must be <= 10000000"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--eval-every", "0"], "--eval-every must be >= 1"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--dim", "10000000"], "--dim must be <= 4096, got 10000000"),
    # each size allowed, their product not
    (["--num-keys", "65536", "--num-values", "65536", "--dim", "2048"], "--dim too large: the "
                                                                        "model would have"),
    (["--eval-size", "1000000", "--num-keys", "4096"], "one batch would need an array of"),
    # files
    (["--save", ""], "--save is empty: give a file name"),
    (["--save-every", "5"], "--save-every needs --save"),
])
def test_bad_values_and_combinations_are_refused_before_training(argv, message, capsys):
    if "--steps" not in argv and "--warmup" in argv and "--schedule" not in argv:
        argv = [*argv, "--steps", "10"]
    tiny = [a for a in TINY_ARGS]
    for option in ("--num-keys", "--num-values", "--num-pairs", "--dim", "--eval-size",
                   "--batch-size"):
        if option in argv or ("teacher" in argv and option != "--batch-size"):
            # the case's own value wins; no kv-recall option on a teacher run
            index = tiny.index(option)
            del tiny[index:index + 2]
    got = usage_error(["train", *argv, *tiny], capsys)
    assert message in got, got


def test_paths_that_cannot_be_written_are_refused_before_training(tmp_path, capsys):
    assert "is a directory" in usage_error(["train", "--save", str(tmp_path), *TINY_ARGS], capsys)
    assert "is a directory" in usage_error(["train", "--plot", str(tmp_path), *TINY_ARGS], capsys)
    missing = tmp_path / "no" / "run.npz"
    assert "does not exist" in usage_error(["train", "--save", str(missing), *TINY_ARGS], capsys)


def test_an_unknown_option_prints_the_train_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("usage: ") and " train [-h] " in err.splitlines()[0]
    assert err.splitlines()[-1].endswith(" train: error: unrecognized arguments: --bogus")


def test_an_unknown_option_of_gradcheck_prints_the_gradcheck_usage(capsys):
    with pytest.raises(SystemExit):
        main(["gradcheck", "--steps", "3"])
    err = capsys.readouterr().err
    assert " gradcheck [-h] " in err and "gradcheck: error: unrecognized arguments: --steps 3" in err


def test_plot_without_matplotlib_is_refused_before_training(tmp_path, monkeypatch, capsys):
    # was: said so before training, then trained and exited 0 with no plot
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    message = usage_error(["train", "--steps", "3", "--plot", str(tmp_path / "out.png"),
                           *TINY_ARGS], capsys)
    assert "matplotlib is not installed" in message and "pip install 'qkvnp[plot]'" in message
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------- resume and the schedule


def test_resume_with_another_horizon_says_the_schedule_changes(tmp_path, capsys):
    # the issue: --steps 300 --save, then --resume --steps 1000: the cosine restarted silently
    path = tmp_path / "run.npz"
    assert main(["train", "--steps", "10", "--save", str(path), *TINY_ARGS]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(path), "--steps", "30", "--quiet"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1
    assert ("the checkpoint's cosine schedule was built for --steps 10; with --steps 30 the "
            "learning rate changes from step 11 on") in notes[0]


@pytest.mark.parametrize("first, second", [
    (["--steps", "30", "--schedule", "constant"], ["--steps", "40"]),  # a constant rate: no change
    (["--steps", "10"], []),  # the checkpoint's own horizon (--steps defaults to it)
])
def test_resume_without_a_schedule_change_says_nothing(tmp_path, capsys, first, second):
    path = tmp_path / "run.npz"
    assert main(["train", *first, "--save", str(path), *TINY_ARGS]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(path), *second, "--quiet"]) == 0
    assert "note:" not in capsys.readouterr().err


# ---------------------------------------------------------------- SIGTERM


def test_sigterm_saves_and_exits_143(tmp_path, monkeypatch, capsys):
    import qkvnp.training.report as report_module

    class SendSigterm(report_module.Progress):
        def __call__(self, info):
            if info["step"] == 7:
                signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(report_module, "Progress", SendSigterm)
    path = tmp_path / "run.npz"
    argv = ["train", "--steps", "20", "--save", str(path),
            *[a for a in TINY_ARGS if a != "--quiet"]]
    assert main(argv) == 143  # was: the process died, nothing saved
    captured = capsys.readouterr()
    assert "SIGTERM: stopping after this step and saving a checkpoint" in captured.err
    assert "stopped at step 7/20" in captured.out and "--resume" in captured.out
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored
    assert load_checkpoint(path).step == 7
    # and the run resumed from it is the run that never stopped
    monkeypatch.undo()
    assert main(["train", "--resume", str(path), "--save", str(path), "--quiet"]) == 0
    straight = train(TrainConfig(steps=20, num_keys=8, num_values=8, num_pairs=4, dim=8,
                                 batch_size=16, eval_size=32))
    resumed = load_checkpoint(path)
    for name, value in straight.model.params.items():
        assert np.array_equal(resumed.params[name], value), name


def test_a_real_sigterm_to_the_process(tmp_path):
    # what a job scheduler does: SIGTERM to the running process
    path = tmp_path / "run.npz"
    argv = [sys.executable, "-m", "qkvnp", "train", "--steps", "100000", "--eval-every", "1",
            "--save", str(path), *[a for a in TINY_ARGS if a != "--quiet"]]
    process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": REPO})
    try:
        first = process.stderr.readline()  # a progress line: training has started
        assert first.startswith("step "), first
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 143, err
    step = load_checkpoint(path).step
    assert 1 <= step < 100000 and f"stopped at step {step}/100000" in out


def test_the_resume_hint_names_the_program_that_was_run(tmp_path, monkeypatch, capsys):
    # oracle: how the user started it (sys.argv[0]); was always "python -m qkvnp", with two
    # spaces before it
    import qkvnp.training.report as report_module

    class SendSigterm(report_module.Progress):
        def __call__(self, info):
            if info["step"] == 2:
                signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(report_module, "Progress", SendSigterm)
    path = tmp_path / "run.npz"
    argv = ["train", "--steps", "20", "--save", str(path),
            *[a for a in TINY_ARGS if a != "--quiet"]]
    for argv0, program in [("/usr/local/bin/qkvnp", "qkvnp"),
                           ("/x/qkvnp/__main__.py", "python -m qkvnp")]:
        monkeypatch.setattr(sys, "argv", [argv0, *argv])
        path.unlink(missing_ok=True)
        assert main(argv) == 143
        out = capsys.readouterr().out
        hint = [line for line in out.splitlines() if line.startswith("interrupted:")]
        assert hint == [f"interrupted: resume with {program} train --resume {path} "
                        f"--save {path}"], out


@pytest.mark.parametrize("warnings", [[], ["-W", "error"]])
def test_divergence_is_one_line_with_or_without_warnings_as_errors(warnings, tmp_path):
    # was: four RuntimeWarning lines before it, or a RuntimeWarning traceback under -W error
    argv = [sys.executable, *warnings, "-m", "qkvnp", "train", "--optimizer", "sgd", "--lr", "10",
            "--steps", "60", *TINY_ARGS]
    result = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: training diverged at step ")


def test_the_first_progress_line_after_resume_has_a_finite_rate(tmp_path, capsys):
    # was "inf steps/s": the rate's clock started at the first callback, after the step
    path = tmp_path / "run.npz"
    assert main(["train", "--steps", "10", "--save", str(path), *TINY_ARGS]) == 0
    capsys.readouterr()
    quiet = [a for a in TINY_ARGS if a != "--quiet"]
    assert main(["train", "--resume", str(path), "--steps", "13", "--eval-every", "1",
                 *quiet]) == 0
    progress = [line for line in capsys.readouterr().err.splitlines()
                if line.startswith("step ")]
    assert len(progress) == 3 and progress[0].startswith("step 11/13")
    for line in progress:
        rate = float(re.search(r"  (\S+) steps/s", line).group(1).replace(",", ""))
        assert 0 < rate < float("inf"), line


# ---------------------------------------------------------------- --version


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip().endswith(f"qkvnp {qkvnp.__version__}")


def test_python_m_qkvnp_version():
    out = subprocess.run([sys.executable, "-m", "qkvnp", "--version"], cwd=REPO,
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": REPO}).stdout
    assert out.strip() == f"python -m qkvnp {qkvnp.__version__}"
