"""The training loop and ``python -m qkvnp train``.

Oracles: the issue's targets measured on held-out data (>= 99% kv-recall
accuracy from a fixed seed; teacher MSE down by >= 1e4); the schedule's
closed form; exact equality of two runs with the same seed (determinism);
the command's exit codes and printed lines.
"""
import io
import math
import sys

import numpy as np
import pytest

from qkvnp.apps.cli import main
from qkvnp.training.loop import TrainConfig, scheduled_lr, train
from qkvnp.training.report import Progress, attention_example, plot_run, summary

# a smaller kv-recall than the command's default (64 keys/values, 16 pairs,
# width 64, 1000 steps), with the same optimizer and schedule
SMALL_KV = dict(num_keys=32, num_values=32, num_pairs=8, dim=32, steps=300, eval_size=1000)
SMALL_TEACHER = dict(task="teacher", embed_dim=8, num_heads=2, seq_len=4, steps=1000, lr=0.02,
                     batch_size=32, eval_size=200)
TINY = ["--num-keys", "8", "--num-values", "8", "--num-pairs", "4", "--dim", "8",
        "--eval-size", "32"]


def test_kv_recall_reaches_99_percent_on_held_out_sequences():
    result = train(TrainConfig(seed=0, **SMALL_KV))
    assert result.step == 300 and not result.interrupted
    assert result.initial_heldout["accuracy"] < 0.2  # it starts near chance (1/32)
    assert result.heldout["accuracy"] >= 0.99, result.heldout


def test_teacher_loss_falls_by_at_least_1e4():
    result = train(TrainConfig(seed=0, **SMALL_TEACHER))
    drop = result.initial_heldout["loss"] / result.heldout["loss"]
    assert result.heldout["accuracy"] is None
    assert drop >= 1e4, (result.initial_heldout, result.heldout)


def test_same_seed_same_run_other_seed_other_run():
    config = TrainConfig(steps=15, num_keys=8, num_values=8, num_pairs=4, dim=8, eval_size=16)
    a, b = train(config), train(config)
    c = train(TrainConfig(**{**config.to_dict(), "seed": 1}))
    assert a.history["loss"] == b.history["loss"]
    assert a.history["loss"] != c.history["loss"]


@pytest.mark.parametrize("optimizer, dtype", [
    ("sgd", "float64"),  # momentum 0.9, its own default lr
    ("adamw", "float64"),
    ("adam", "float32"),  # float32 end to end
])
def test_every_optimizer_and_dtype_learns(optimizer, dtype):
    # oracle: the held-out target (chance is 1/16 = 6.25%), and a loss 10x below its start
    result = train(TrainConfig(optimizer=optimizer, dtype=dtype, steps=300, num_keys=16,
                               num_values=16, num_pairs=4, dim=16, eval_size=200))
    assert all(p.dtype == np.dtype(dtype) for p in result.model.params.values())
    assert result.heldout["loss"] < 0.1 * result.initial_heldout["loss"]
    assert result.heldout["accuracy"] >= 0.95


def test_history_and_evaluation_schedule():
    result = train(TrainConfig(steps=25, eval_every=10, num_keys=8, num_values=8, num_pairs=4,
                               dim=8, eval_size=16))
    history = result.history
    assert history["step"] == list(range(1, 26))
    assert len(history["loss"]) == len(history["accuracy"]) == len(history["lr"]) == 25
    assert history["eval_step"] == [10, 20, 25]  # every 10 steps and the last
    assert history["eval_loss"][-1] == result.heldout["loss"]


def test_cosine_schedule_closed_form():
    config = TrainConfig(lr=1.0, steps=100, warmup=10).resolved()
    # oracle: lr * min(1, t / warmup) * (1 + cos(pi (t - 1) / steps)) / 2
    for step in (1, 5, 10, 11, 50, 100):
        expected = min(1, step / 10) * 0.5 * (1 + math.cos(math.pi * (step - 1) / 100))
        assert scheduled_lr(config, step) == pytest.approx(expected, rel=1e-15)
    assert scheduled_lr(config, 100) > 0  # the last step still moves
    constant = TrainConfig(lr=0.3, schedule="constant").resolved()
    assert scheduled_lr(constant, 1) == scheduled_lr(constant, 999) == 0.3


def test_resolved_defaults_per_task_and_optimizer():
    assert TrainConfig().resolved().steps == 1000
    assert TrainConfig().resolved().lr == 5e-3
    assert TrainConfig(task="teacher").resolved().lr == 2e-2
    assert TrainConfig(optimizer="sgd").resolved().lr == 0.05
    assert TrainConfig(optimizer="adamw").resolved().weight_decay == 0.01
    assert TrainConfig().resolved().weight_decay == 0.0
    assert TrainConfig(steps=300).resolved().eval_every == 30


@pytest.mark.parametrize("changes, error, match", [
    (dict(task="sorting"), ValueError, "task must be one of"),
    (dict(steps=0), ValueError, "steps must be >= 1"),
    (dict(lr=-1.0), ValueError, "lr must be > 0"),
    (dict(lr=float("nan")), TypeError, "lr must be a finite number"),
    (dict(batch_size=2.5), TypeError, "batch_size must be an int"),
    (dict(variant="qk"), ValueError, "variant must be one of"),
    (dict(dtype="float16"), ValueError, "dtype must be one of"),
    (dict(num_pairs=80), ValueError, "num_pairs must be <= num_keys=64"),
])
def test_bad_configuration_is_refused(changes, error, match):
    with pytest.raises(error, match=match):
        train(TrainConfig(**changes))


def test_divergence_is_reported_not_hidden():
    with pytest.raises(FloatingPointError, match="diverged at step .* lower the learning rate"):
        with np.errstate(over="ignore", invalid="ignore"):
            train(TrainConfig(optimizer="sgd", lr=1e6, steps=50, num_keys=8, num_values=8,
                              num_pairs=4, dim=8, eval_size=16))


# ---------------------------------------------------------------- progress


def _run_progress(live):
    stream = io.StringIO()
    progress = Progress(stream=stream, live=live, interval=0.0)
    train(TrainConfig(steps=20, eval_every=5, num_keys=8, num_values=8, num_pairs=4, dim=8,
                      eval_size=16), callback=progress)
    progress.close()
    return stream.getvalue()


def test_progress_without_a_terminal_prints_one_line_per_evaluation():
    lines = _run_progress(live=False).splitlines()
    assert len(lines) == 4  # steps 5, 10, 15, 20
    assert lines[-1].startswith("step 20/20  loss ")
    for field in ("acc", "held-out", "lr", "steps/s", "left"):
        assert field in lines[-1], field
    assert "\r" not in "".join(lines)


def test_progress_without_a_terminal_also_prints_on_a_timer():
    stream = io.StringIO()
    progress = Progress(stream=stream, live=False, plain_interval=0.0)
    train(TrainConfig(steps=6, eval_every=100, num_keys=8, num_values=8, num_pairs=4, dim=8,
                      eval_size=16), callback=progress)
    assert len(stream.getvalue().splitlines()) == 6  # no evaluation before the last step


def test_progress_on_a_terminal_rewrites_one_line():
    text = _run_progress(live=True)
    assert text.count("\r") == 20 and text.endswith("\n") and text.count("\n") == 1
    assert "step 20/20" in text.rsplit("\r", 1)[1]


# ---------------------------------------------------------------- command line


def test_cli_train_smoke(capsys):
    assert main(["train", "--steps", "20", "--quiet", *TINY]) == 0
    out = capsys.readouterr().out
    assert "kv-recall: 4 key/value pairs per sequence" in out
    assert "done at step 20/20: 20 steps in" in out
    assert "held-out accuracy" in out and "chance 12.5%" in out


def test_cli_teacher_smoke(capsys):
    argv = ["train", "--task", "teacher", "--steps", "20", "--embed-dim", "8", "--seq-len", "4",
            "--eval-size", "16"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "held-out MSE" in captured.out and "x from" in captured.out
    assert "step 20/20" in captured.err  # progress goes to stderr


def test_cli_refuses_bad_options_with_exit_code_2(capsys):
    assert main(["train", "--steps", "0"]) == 2
    assert "steps must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["train", "--optimizer", "lbfgs"])
    assert exc.value.code == 2


def test_cli_reports_divergence_with_exit_code_1(capsys):
    with np.errstate(over="ignore", invalid="ignore"):
        code = main(["train", "--optimizer", "sgd", "--lr", "1e6", "--steps", "50", "--quiet",
                     *TINY])
    assert code == 1
    assert "diverged" in capsys.readouterr().err


@pytest.mark.parametrize("task", ["kv-recall", "teacher"])
def test_attention_example_for_the_heat_map(task):
    result = train(TrainConfig(task=task, steps=5, num_keys=8, num_values=8, num_pairs=4, dim=8,
                               embed_dim=8, seq_len=4, eval_size=16))
    weights, xlabels, ylabels, title = attention_example(result)
    expected = (1, 4) if task == "kv-recall" else (4, 4)
    assert weights.shape == expected
    assert (len(ylabels), len(xlabels)) == expected
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=1e-12)  # rows of softmax
    assert title


def test_summary_of_a_teacher_run_reports_the_drop():
    result = train(TrainConfig(task="teacher", steps=5, embed_dim=8, seq_len=4, eval_size=16))
    line = summary(result)[1]
    drop = result.initial_heldout["loss"] / result.heldout["loss"]
    assert line.startswith("held-out MSE") and f"down {drop:.3g}x" in line


@pytest.fixture
def stand_in_matplotlib(monkeypatch):
    """matplotlib is not installed here: a stand-in records the calls, and its
    savefig writes bytes, so the figure's assembly and atomic write still run.

    Yields ``(calls, axes)``: the formats saved, and the two axes of the figure.
    """
    import types
    from unittest import mock

    calls, axes = [], []

    class Figure(mock.MagicMock):
        def subplots(self, *args, **kwargs):
            axes.extend([mock.MagicMock(), mock.MagicMock()])
            return tuple(axes)

        def savefig(self, file, format, dpi):
            calls.append(format)
            file.write(b"\x89PNG stand-in")

    matplotlib = types.ModuleType("matplotlib")
    figure_module = types.ModuleType("matplotlib.figure")
    figure_module.Figure = Figure
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", figure_module)
    return calls, axes


def test_plot_code_path_with_a_stand_in_matplotlib(tmp_path, stand_in_matplotlib, capsys):
    calls, axes = stand_in_matplotlib
    result = train(TrainConfig(steps=10, num_keys=8, num_values=8, num_pairs=4, dim=8,
                               eval_size=16))
    path = tmp_path / "out.png"
    assert plot_run(result, path) is True
    assert path.read_bytes() == b"\x89PNG stand-in" and calls == ["png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.png"]  # no temporary left
    assert "plot written to" in capsys.readouterr().out
    loss_axes, heat_axes = axes
    assert list(loss_axes.plot.call_args_list[0][0][0]) == list(range(1, 11))  # steps
    heat = heat_axes.imshow.call_args[0][0]
    assert heat.shape == (1, 4)  # the query's weights over the 4 stored pairs
    np.testing.assert_allclose(heat.sum(), 1.0, rtol=1e-12)


def test_plot_after_a_resume_shows_the_whole_run(tmp_path, stand_in_matplotlib, capsys):
    # oracle: the checkpoint stores the history, so the curve starts at step 1, not at 11,
    # and its values are those of the run that never stopped (with a constant learning
    # rate: the cosine schedule depends on --steps, which the resume changes)
    calls, axes = stand_in_matplotlib
    path, out_png = tmp_path / "run.npz", tmp_path / "out.png"
    argv = ["train", "--quiet", *TINY, "--eval-every", "5", "--schedule", "constant"]
    assert main([*argv, "--steps", "10", "--save", str(path)]) == 0
    assert main(["train", "--quiet", "--steps", "20", "--resume", str(path), "--plot",
                 str(out_png)]) == 0
    out = capsys.readouterr().out
    assert "done at step 20/20: 10 steps in" in out and "plot written to" in out
    straight = train(TrainConfig(steps=20, eval_every=5, schedule="constant", num_keys=8,
                                 num_values=8, num_pairs=4, dim=8, eval_size=32))
    loss_axes, _ = axes
    (steps, losses), _ = loss_axes.plot.call_args_list[0]
    assert list(steps) == list(range(1, 21)) and list(losses) == straight.history["loss"]
    (eval_steps, eval_losses, _), _ = loss_axes.plot.call_args_list[1]
    assert list(eval_steps) == [5, 10, 15, 20]
    assert list(eval_losses) == straight.history["eval_loss"]
