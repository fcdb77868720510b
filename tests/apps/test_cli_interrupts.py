"""Ctrl-C and SIGTERM during ``ablation`` and ``gradcheck``; every command under ``python -OO``.

Oracles: the shell's convention for a process a signal stopped (exit status
128 + the signal: 130 for SIGINT, 143 for SIGTERM); the progress lines the
ablation printed, one per finished run, against the runs its ``--json``
holds (a run the signal cut short must not be among them); the files on disk
(what was not finished is not written); one line on stderr and no
traceback; under ``-OO`` (docstrings are None), the same exit status and
last line as without.
"""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

import qkvnp.apps.cli
from qkvnp.apps.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_LOOKUP = ["--num-keys", "8", "--num-values", "8", "--num-pairs", "4", "--eval-size", "16"]


def _start(argv, tmp_path):
    """``python -m qkvnp argv`` with SIGINT as in a terminal, unbuffered, in ``tmp_path``."""
    def default_sigint():
        # NOTE: a shell's background job inherits SIGINT ignored; Python then
        # installs no KeyboardInterrupt handler. A terminal's Ctrl-C is not ignored.
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "qkvnp", *argv], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)


def _wait_for(stream, pattern, seen):
    """Read ``stream`` line by line into ``seen`` until a line matches ``pattern``."""
    for line in stream:
        seen.append(line)
        if re.search(pattern, line):
            return line
    raise AssertionError(f"no line matching {pattern!r} in {''.join(seen)!r}")


# ---------------------------------------------------------------- ablation


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_ablation_keeps_only_its_finished_runs(tmp_path, signum):
    # 40 short runs: the signal comes while the second (or a later) one trains
    argv = ["ablation", "--task", "kv-recall", "--seeds", "20", "--steps", "400", "--dims", "4",
            "--variants", "separate,tied_qk", *TINY_LOOKUP, "--json", "a.json"]
    process = _start(argv, tmp_path)
    err = []
    try:
        _wait_for(process.stderr, r"^\[ *1/40\]", err)
        process.send_signal(signum)
        out, rest = process.communicate(timeout=120)
    finally:
        process.kill()
    err += rest.splitlines(keepends=True)
    assert process.returncode == 128 + signum, "".join(err)  # was 0: the study ran on
    assert "Traceback" not in "".join(err)
    finished = [line for line in err if re.match(r"\[ *\d+/40\]", line)]
    assert 1 <= len(finished) < 40
    last = err[-1]
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert last.startswith(f"{name}: the ablation stopped "), last
    assert f"kept the {len(finished)} finished run" in last and "a.json" in last, last
    if "during run" in last:  # the usual case: the signal came while a run trained
        assert f"during run {len(finished) + 1}/40 (" in last and "which was dropped" in last
    else:  # it came between two runs
        assert f"stopped after run {len(finished)}/40;" in last, last
    assert "ablation" not in out  # no table: a study cut short has no summary
    # the JSON holds exactly the runs whose progress line was printed, each complete
    document = json.loads((tmp_path / "a.json").read_text())
    runs = {(entry["variant"], seed) for entry in document["kv-recall"] for seed in entry["seeds"]}
    printed = {(re.search(r"width +4 (\S+) +seed (\d+)", line).group(1),
                int(re.search(r"seed (\d+)", line).group(1))) for line in finished}
    assert runs == printed
    assert all(entry["steps"] == 400 for entry in document["kv-recall"])
    assert not list(tmp_path.glob("qkvnp-*.npz"))  # no checkpoint of the dropped run


def test_run_ablation_raises_with_the_finished_rows_when_a_run_is_stopped(monkeypatch):
    # oracle: the rows of the runs before the stopped one; the stopped run's step count
    import qkvnp.training.loop as loop
    from qkvnp.training.ablation import AblationInterrupted, run_ablation

    original = loop.train
    calls = []

    def train(config, **kwargs):
        calls.append(kwargs)
        result = original(config, **kwargs)
        if len(calls) == 2:  # the second run is stopped at its step 3, as by SIGTERM
            return result._replace(interrupted=True, step=3, signal=signal.SIGTERM)
        return result

    monkeypatch.setattr(loop, "train", train)
    with pytest.raises(AblationInterrupted) as info:
        run_ablation(("separate",), seeds=3, dims=(4,), steps=5,
                     base=dict(num_keys=8, num_values=8, num_pairs=4, eval_size=8))
    assert [row["seed"] for row in info.value.rows] == [0]
    assert info.value.stopped["seed"] == 1 and info.value.stopped["step"] == 3
    assert info.value.stopped["steps"] == 5
    assert info.value.signal == signal.SIGTERM
    assert all(kwargs.get("save_on_interrupt") is False for kwargs in calls)


# ---------------------------------------------------------------- gradcheck


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_sweep_writes_nothing_and_says_so_in_one_line(tmp_path, signum):
    argv = ["gradcheck", "--sweep-eps", "--batch", "2", "--seq", "6", "--embed", "16",
            "--heads", "2", "--d-out", "8", "--json", "curves.json"]
    process = _start(argv, tmp_path)
    seen = []
    try:
        _wait_for(process.stdout, r"^max relative error", seen)
        process.send_signal(signum)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    # was: a traceback (Ctrl-C) or death by the signal, exit -15 (SIGTERM)
    assert process.returncode == 128 + signum, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "gradcheck stopped before it finished" in lines[0]
    assert "nothing was written" in lines[0]
    assert not (tmp_path / "curves.json").exists()
    assert not list(tmp_path.iterdir())  # no temporary file left either


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_check_exits_with_the_signal_status_and_one_line(monkeypatch, capsys,
                                                                        signum):
    import qkvnp.gradcheck.command as command

    # Ctrl-C raises KeyboardInterrupt; main's SIGTERM handler, an Interrupted
    interrupt = KeyboardInterrupt() if signum == signal.SIGINT else qkvnp.apps.cli.Interrupted(signum)

    calls = []
    original = command.check_layer

    def check_layer(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second layer's check is interrupted
            raise interrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(command, "check_layer", check_layer)
    try:
        status = main(["gradcheck", "--batch", "1", "--seq", "2", "--embed", "2", "--heads", "1",
                       "--d-out", "2"])
    except KeyboardInterrupt:  # was: a traceback
        pytest.fail("the interrupt escaped main()")
    assert status == 128 + signum
    captured = capsys.readouterr()
    assert "SelfAttention(" in captured.out  # the finished table stays
    assert captured.err.count("\n") == 1 and "gradcheck stopped before it finished" in captured.err


def test_main_restores_the_sigterm_handler():
    # oracle: the handler before the call
    before = signal.getsignal(signal.SIGTERM)
    assert main(["gradcheck", "--batch", "1", "--seq", "2", "--embed", "2", "--heads", "1",
                 "--d-out", "2"]) == 0
    assert signal.getsignal(signal.SIGTERM) is before


# ---------------------------------------------------------------- python -OO


@pytest.mark.parametrize("argv", [
    ["demo"],
    ["gradcheck", "--batch", "1", "--seq", "2", "--embed", "2", "--heads", "1", "--d-out", "2"],
    ["train", "--steps", "2", "--dim", "4", "--batch-size", "4", "--quiet", *TINY_LOOKUP],
    ["ablation", "--task", "partner", "--seeds", "1", "--steps", "2", "--dims", "4",
     "--variants", "separate", "--quiet", *TINY_LOOKUP],
    ["train", "--help"],
])
def test_every_command_runs_without_docstrings(argv, tmp_path):
    # was: AttributeError: 'NoneType' object has no attribute 'strip' (__doc__ is None)
    env = {**os.environ, "PYTHONPATH": REPO}
    result = subprocess.run([sys.executable, "-OO", "-m", "qkvnp", *argv], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.strip()
