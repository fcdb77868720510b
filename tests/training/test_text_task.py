"""The byte-level text task (``train --task text``) and ``generate``.

Oracles: a naive loop over byte pairs for the bigram baseline; the split's
definition (last 10%); a run stopped and resumed equals the same run made
in one go, bit for bit; SIGTERM saves and exits 143; the generate command
continues its prompt with what :func:`qkvnp.generate` gives.
"""
import math
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from qkvnp.apps.cli import main
from qkvnp.training import text as text_task

SMALL = ["--context", "8", "--emb-dim", "8", "--num-heads", "2", "--num-layers", "1",
         "--batch-size", "4", "--eval-windows", "4", "--sample-length", "10", "--warmup", "2"]


def test_bigram_loss_equals_a_naive_count():
    train = np.frombuffer(b"abracadabra", dtype=np.uint8)
    inputs, targets = np.array([[97, 98]]), np.array([[98, 114]])  # "ab", "br"
    pairs = list(zip(train[:-1], train[1:]))

    def p(a, b):
        return (sum(1 for x, y in pairs if (x, y) == (a, b)) + 1) / \
            (sum(1 for x, _ in pairs if x == a) + 256)

    expected = -(math.log(p(97, 98)) + math.log(p(98, 114))) / 2
    assert text_task.bigram_loss(train, inputs, targets) == pytest.approx(expected, rel=1e-12)


def test_the_last_tenth_is_held_out_and_the_default_corpus_is_deterministic():
    train, held = text_task.split_text(bytes(range(200)) * 5, context=8)
    assert len(held) == 100 and bytes(held.tolist()) == (bytes(range(200)) * 5)[-100:]
    with pytest.raises(ValueError, match="held-out 10% must hold more than --context"):
        text_task.split_text(b"x" * 50, context=8)
    a, source = text_task.default_corpus(10_000)
    b, _ = text_task.default_corpus(10_000)
    assert a == b and len(a) == 10_000 and "*.py" in source


def test_a_run_prints_losses_bits_baseline_and_samples(corpus, tmp_path, capsys):
    save = str(tmp_path / "run.npz")
    code = main(["train", "--task", "text", "--text", corpus, "--steps", "6", "--eval-every",
                 "3", "--sample-every", "3", "--save", save] + SMALL)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "bigram baseline (add-one smoothing), held-out loss" in out
    assert out.count("bits/byte") >= 5 and out.count("sample at step") == 2
    assert os.path.exists(save)


def test_stopping_and_resuming_equals_one_uninterrupted_run(corpus, tmp_path, capsys):
    whole, part = str(tmp_path / "whole.npz"), str(tmp_path / "part.npz")
    args = ["train", "--task", "text", "--text", corpus, "--eval-every", "2",
            "--sample-every", "100", "--dropout", "0.1"] + SMALL
    assert main(args + ["--steps", "6", "--save", whole]) == 0
    config = text_task.TextConfig(text=corpus, steps=6, eval_every=2, sample_every=100,
                                  dropout=0.1, context=8, emb_dim=8, num_heads=2, num_layers=1,
                                  batch_size=4, eval_windows=4, sample_length=10, warmup=2)
    text_task.train_text(config, save=part, stop_at=3)  # as SIGTERM after step 3 would
    assert text_task.load_text_checkpoint(part)[1].step == 3
    assert main(args + ["--steps", "6", "--save", part, "--resume", part]) == 0
    capsys.readouterr()
    a, saved_a = text_task.load_text_checkpoint(whole)
    b, saved_b = text_task.load_text_checkpoint(part)
    assert saved_a.step == saved_b.step == 6
    for name, value in a.params.items():
        np.testing.assert_array_equal(b.params[name], value)
    for name, value in saved_a.optimizer_state.items():
        np.testing.assert_array_equal(saved_b.optimizer_state[name], value)
    assert saved_a.history == saved_b.history


def test_resume_refuses_another_model(corpus, tmp_path, capsys):
    save = str(tmp_path / "run.npz")
    base = ["train", "--task", "text", "--text", corpus, "--steps", "2", "--eval-every", "1",
            "--sample-every", "100"] + SMALL
    assert main(base + ["--save", save]) == 0
    code = main(base + ["--resume", save, "--emb-dim", "4"])
    assert code == 2
    assert "trained with other --emb-dim" in capsys.readouterr().err


def test_bad_options_are_refused_before_training(corpus, capsys):
    code = main(["train", "--task", "text", "--text", corpus, "--emb-dim", "6", "--num-heads",
                 "4"])
    assert code == 2
    assert "--emb-dim must be divisible by --num-heads" in capsys.readouterr().err


def test_generate_continues_the_prompt_with_qkvnp_generate(corpus, tmp_path, capsys):
    import qkvnp

    save = str(tmp_path / "run.npz")
    assert main(["train", "--task", "text", "--text", corpus, "--steps", "4", "--eval-every",
                 "2", "--sample-every", "100", "--save", save] + SMALL) == 0
    capsys.readouterr()
    assert main(["generate", "--resume", save, "--prompt", "the cat", "--max-new-tokens", "12",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    model, _ = text_task.load_text_checkpoint(save)
    idx = np.frombuffer(b"the cat", dtype=np.uint8).astype(np.int64)[None]
    expected = qkvnp.generate(model.eval(), idx, 12)[0, 7:].astype(np.uint8).tolist()
    assert out == "the cat" + bytes(expected).decode("utf-8", "replace") + "\n"
    assert main(["generate", "--resume", corpus, "--prompt", "x"]) == 2


@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or sys.platform == "win32",
                    reason="POSIX signals")
def test_sigterm_saves_a_checkpoint_and_exits_143(corpus, tmp_path):
    save = str(tmp_path / "run.npz")
    cwd = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    process = subprocess.Popen(
        [sys.executable, "-m", "qkvnp", "train", "--task", "text", "--text", corpus, "--steps",
         "1000000", "--eval-every", "1", "--sample-every", "1000000", "--save", save] + SMALL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    for line in process.stdout:
        if line.startswith("step"):
            break
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143, err
    _, saved = text_task.load_text_checkpoint(save)
    assert saved.step >= 1


def test_the_attention_of_recent_models_trains_saves_and_writes(corpus, tmp_path, capsys):
    # oracle: the checkpoint's model is the GPTModel built with those options (its
    # attention says so), generate gives qkvnp.generate's tokens through the rolling
    # caches, and a resume with another window is refused naming --window
    import qkvnp

    save = str(tmp_path / "modern.npz")
    options = ["--kv-heads", "1", "--rope", "--window", "4", "--softcap", "20"]
    base = ["train", "--task", "text", "--text", corpus, "--eval-every", "2",
            "--sample-every", "100"] + SMALL + options
    assert main(base + ["--steps", "4", "--save", save]) == 0
    out = capsys.readouterr().out
    assert "1 layers, num_kv_heads=1, rope=True, window=(3, 0), softcap=20.0)" in out
    model, _ = text_task.load_text_checkpoint(save)
    att = model.trf_blocks[0].att
    assert (att.num_kv_heads, att.variants.rope, att.variants.window, att.variants.softcap) == \
        (1, True, (3, 0), 20.0)
    assert main(["generate", "--resume", save, "--prompt", "the cat", "--max-new-tokens", "12",
                 "--temperature", "0"]) == 0
    idx = np.frombuffer(b"the cat", dtype=np.uint8).astype(np.int64)[None]
    expected = qkvnp.generate(model.eval(), idx, 12)[0, 7:].astype(np.uint8).tolist()
    assert capsys.readouterr().out == "the cat" + bytes(expected).decode("utf-8", "replace") + "\n"
    assert main(base[:-2] + ["--window", "5", "--steps", "6", "--resume", save]) == 2
    assert "trained with other --window" in capsys.readouterr().err


def test_a_text_checkpoint_of_the_earlier_format_is_refused_with_advice(corpus, tmp_path):
    # oracle: the earlier format (one JSON 'meta' entry, no sampling generator state, so it
    # cannot continue a run bit for bit) is one CheckpointError that says to train again
    from qkvnp.training.checkpoint import CheckpointError, write_npz_atomic

    save = str(tmp_path / "old.npz")
    write_npz_atomic(save, {"param/tok_emb.weight": np.zeros((256, 8), np.float32),
                            "meta": np.array('{"format": "qkvnp-text-gpt-1"}')})
    with pytest.raises(CheckpointError, match="text checkpoint of an earlier qkvnp.*train again"):
        text_task.load_text_checkpoint(save)


@pytest.mark.parametrize("options, message", [
    (["--kv-heads", "3"], "--kv-heads must divide --num-heads \\(2\\), got 3"),
    (["--rope", "--emb-dim", "6"], "--rope rotates pairs: .* must be even, got 3"),
    (["--window", "0"], "--window must be >= 1"),
    (["--softcap", "-1"], "--softcap must be a finite number > 0"),
])
def test_bad_attention_options_are_refused_naming_the_option(corpus, capsys, options, message):
    import re

    code = main(["train", "--task", "text", "--text", corpus] + SMALL + options)
    assert code == 2
    assert re.search(message, capsys.readouterr().err)
