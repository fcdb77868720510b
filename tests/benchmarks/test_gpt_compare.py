"""Tests of the GPT benchmark (benchmarks/gpt_compare.py, its modules): fast, no timing asserted.

Oracles: the FLOPs of a GPT step in closed form; qkvnp's GPTModel (itself
checked against autograd in tests/models/test_gpt_torch.py) for the benchmark's
torch model, in float64; the torch model's full recompute for its KV-cache
decoding; the loss check against known perturbations; the command's exit
status and JSON report on a tiny configuration (the libraries' losses and
tokens cross-checked by the command itself); a lower bound in closed form
for the step's traced memory.
"""
import json
import os
import sys

import numpy as np
import pytest

# The harness lives beside the package (the wheel does not ship it): import
# the checkout's benchmarks package, as test_bench.py does.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                os.pardir, os.pardir)))
from benchmarks import gpt_compare  # noqa: E402  (benchmarks/gpt_compare.py)
from benchmarks.harness import workers  # noqa: E402
from benchmarks.rivals.gpt_torch import book_gpt, generate_cached  # noqa: E402
from benchmarks.workloads.gpt import (BATCHES, LOSS_TOLERANCE, GPTConfig,  # noqa: E402
                                      book_config, make_data, products_flops, step_products)

import qkvnp  # noqa: E402
from qkvnp.interop import to_torch  # noqa: E402

TINY = GPTConfig(64, 16, 16, 2, 1, 2)
TRAIN = GPTConfig(64, 16, 16, 2, 1, 2, 8)  # the command trains on windows shorter than C
TINY_ARGS = ["--configs", "64,16,16,2,1,2,8", "--generate", "64,16,16,2,1,2", "--repeats", "1",
             "--warmup", "0", "--pause", "0", "--round-time", "0.001", "--no-memory",
             "--torch-threads", "1"]  # seconds on a busy machine (2 threads: 25 s)


def _has_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("config", [
    GPTConfig(256, 64, 64, 4, 2, 8),    # the tiny configuration
    GPTConfig(256, 128, 128, 4, 4, 8),  # the small one
    GPTConfig(7, 5, 6, 3, 3, 2),        # odd sizes
    GPTConfig(64, 32, 16, 2, 1, 2, 8),  # windows of T = 8 tokens, shorter than the context
    GPTConfig(50257, 1024, 768, 12, 12, 4, 64),  # gpt2: the book's 124M at 4 x 64 tokens
])
def test_step_products_count_the_flops_of_a_gpt_step(config):
    # oracle: forward = 2 * B*T * (12 L E^2 + E V) (projections, feed-forward,
    # head) + 4 L B T^2 E (Q K^T and P V over all heads); backward = 2 x forward;
    # T is the window, whatever the context C
    V, C, E, H, L, B, _ = config
    T = C if config.tokens is None else config.tokens
    forward = 2 * B * T * (12 * L * E * E + E * V) + 4 * L * B * T * T * E
    assert products_flops(step_products(config)) == 3 * forward


def test_step_products_have_t_rows_a_window():
    # oracle: the shapes by hand at B 2, T 8, E 16, H 2 (D 8), V 64: the
    # projections have B*T = 16 rows, the heads' scores are (T, T)
    products = step_products(GPTConfig(64, 32, 16, 2, 1, 2, 8))
    assert products[:5] == [(1, 16, 16, 16)] * 3 + [(4, 8, 8, 8), (4, 8, 8, 8)]
    assert products[8] == (1, 16, 16, 64)  # the head


def test_seven_numbers_give_the_window_and_six_the_context():
    # oracle: the config as written, T defaulting to C
    name, config = gpt_compare._config("64,32,16,2,1,2,8")
    assert name == "64,32,16,2,1,2,8" and config == GPTConfig(64, 32, 16, 2, 1, 2, 8)
    assert config.seq_len == 8
    _, config = gpt_compare._config("64,32,16,2,1,2")
    assert config.tokens is None and config.seq_len == 32
    _, config = gpt_compare._config("gpt2")
    assert tuple(config) == (50257, 1024, 768, 12, 12, 4, 64)


@pytest.mark.parametrize("text, message", [
    ("64,32,16,2,1,2,33", "T at most the context"),  # a window longer than the context
    ("64,32,16,2,1", "six or seven integers"),        # too few
    ("64,32,16,2,1,2,8,1", "six or seven integers"),  # too many
])
def test_bad_window_is_refused_by_name(text, message, capsys):
    with pytest.raises(SystemExit):
        gpt_compare.main(["--configs", text])
    assert message in capsys.readouterr().err


def test_make_data_gives_windows_of_t_tokens():
    # oracle: the shapes asked for, and targets equal to the inputs shifted by one
    config = GPTConfig(64, 32, 16, 2, 1, 2, 8)
    data = make_data(config)
    assert data["inputs"].shape == data["targets"].shape == (BATCHES, 2, 8)
    np.testing.assert_array_equal(data["inputs"][..., 1:], data["targets"][..., :-1])
    assert data["param/pos_emb.weight"].shape == (32, 16)  # the model keeps C positions


def _book_model(torch, config, seed=0):
    """The benchmark's torch model and qkvnp's GPTModel with the same float64 weights."""
    ours = qkvnp.GPTModel.from_config(book_config(config), rng=seed)
    theirs = book_gpt(torch)(book_config(config)).double()
    missing, unexpected = theirs.load_state_dict(
        {name: torch.from_numpy(value) for name, value in to_torch(ours, "book.GPTModel").items()},
        strict=False)
    assert not unexpected and all(name.endswith(".att.mask") for name in missing)
    return ours, theirs


def test_torch_book_model_is_qkvnp_gpt_model(torch):
    # oracle: qkvnp's GPTModel, equal to the book's under autograd (test_gpt_torch.py):
    # the benchmark's torch model computes the same logits and parameter gradients
    ours, theirs = _book_model(torch, TINY)
    idx = np.random.default_rng(1).integers(0, TINY.vocab, size=(3, TINY.context))
    logits = theirs(torch.from_numpy(idx))
    expected = ours.forward(idx)
    assert tuple(logits.shape) == expected.shape
    np.testing.assert_allclose(logits.detach().numpy(), expected, rtol=1e-10, atol=1e-12)
    dlogits = np.random.default_rng(2).standard_normal(expected.shape)
    logits.backward(torch.from_numpy(dlogits))
    ours.backward(dlogits)
    grads = {name: p.grad.numpy() for name, p in theirs.named_parameters()}
    for name, value in to_torch(_with_params(ours, ours.grads), "book.GPTModel").items():
        scale = max(1.0, np.abs(value).max())
        np.testing.assert_allclose(grads[name] / scale, value / scale, atol=1e-10, err_msg=name)


def _with_params(model, arrays):
    """``model`` with its parameter arrays replaced by ``arrays`` (same keys), for to_torch."""
    clone = qkvnp.GPTModel.from_config(book_config(TINY), rng=0)
    for name, value in arrays.items():
        clone.params[name][...] = value
    return clone


def test_torch_kv_cache_decoding_equals_recomputing_the_context(torch):
    # oracle: the same model recomputing the whole context at every step
    _, theirs = _book_model(torch, TINY)
    prompt = torch.from_numpy(np.random.default_rng(3).integers(0, TINY.vocab, size=(2, 3)))
    steps = TINY.context - 3
    tokens = generate_cached(torch, theirs, prompt, steps)
    assert tuple(tokens.shape) == (2, TINY.context)
    expected = prompt
    with torch.no_grad():
        for _ in range(steps):
            logits = theirs(expected)[:, -1]
            expected = torch.cat([expected, logits.argmax(dim=-1, keepdim=True)], dim=1)
        # and the cached logits of a chunk equal the full forward's rows
        theirs.reset_kv_cache()
        first = theirs(tokens[:, :5], use_cache=True)
        second = theirs(tokens[:, 5:9], use_cache=True)
        full = theirs(tokens[:, :9])
    assert torch.equal(tokens, expected)
    np.testing.assert_allclose(torch.cat([first, second], dim=1).numpy(), full.numpy(),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("relative, accepted", [
    (1e-7, True),    # float32 rounding: agreement
    (1e-3, False),   # another trajectory
])
def test_loss_check_refuses_a_different_trajectory(relative, accepted):
    # oracle: a known perturbation of a known loss sequence
    losses = np.array([5.5, 5.4, 5.3])
    error, ok = gpt_compare.check_losses(losses * (1 + relative * np.array([0, 1, -1])), losses)
    assert ok is accepted
    assert error == pytest.approx(relative, rel=1e-6)
    assert gpt_compare.check_losses([np.nan, 1, 1], losses) == (float("inf"), False)
    assert relative < LOSS_TOLERANCE if accepted else relative > LOSS_TOLERANCE


def test_command_on_a_tiny_config(tmp_path, capsys):
    # oracle: exit status 0 (the two libraries' first losses agreed and they
    # generated the same tokens; without torch qkvnp alone is timed), and the
    # JSON report holds what was asked for
    path = tmp_path / "gpt.json"
    status = gpt_compare.main(TINY_ARGS + ["--json", str(path)])
    out = capsys.readouterr().out
    assert status == 0, out
    with open(path) as stream:
        report = json.load(stream)
    assert os.listdir(tmp_path) == ["gpt.json"]  # no temporary file left behind
    (train,), (generate,) = report["train"], report["generate"]
    assert train["shape"] == list(TRAIN)
    assert generate["shape"] == list(TINY._replace(batch=1, tokens=16))  # T written out
    assert train["status"] == generate["status"] == "ok"
    assert len(train["qkvnp"]["times_ms"]) == 1 and train["qkvnp"]["per_s"] > 0
    assert train["products"]["flops"] == products_flops(step_products(TRAIN))
    assert train["products"]["handoff_us"] > 0  # a round trip to a second thread takes time
    assert generate["new_tokens"] == TINY.context - make_data(TINY)["prompt"].shape[1]
    if _has_torch():
        assert train["check"]["max_rel_err"] <= LOSS_TOLERANCE
        assert generate["same_tokens"] is True
        assert train["ratio"] == pytest.approx(train["qkvnp"]["per_s"] / train["torch"]["per_s"])
        assert "floor_ratio" in train["products"]
        if train["met"] is False:  # the one-core budget and the hand-off are printed
            assert "on one core the target's" in out and "a hand-off to another thread" in out
    else:
        assert train["torch"] is None and "not installed" in train["reason"]
    assert "Training: one step" in out and "Generation: batch 1" in out


def test_bad_configuration_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        gpt_compare.main(["--configs", "64,16,15,2,1,2"])
    assert "E divisible by H" in capsys.readouterr().err


def test_step_memory_of_qkvnp_in_a_fresh_process():
    # oracle: the step's logits (B, C, V) float32 are alive at its peak, so
    # the traced peak is at least their size; the peak RSS during the step is
    # at least the RSS before it
    config = GPTConfig(256, 16, 16, 2, 1, 4)
    measured = gpt_compare.measure_step_memory("qkvnp", config)
    assert "error" not in measured, measured
    logits_mib = config.batch * config.context * config.vocab * 4 / 2.0 ** 20
    assert measured["tracemalloc_mib"] >= logits_mib, measured
    assert measured["step_mib"] >= 0, measured


def test_profile_of_a_qkvnp_step_gives_shares_of_its_time(tmp_path):
    # oracle: each function's own time is part of the profiled total, so the
    # shares lie in [0, 1], come largest first and sum to at most 1
    worker = workers.Worker("qkvnp", gpt_compare.CHILD_PATH, module="benchmarks.workloads.gpt")
    try:
        path = str(tmp_path / "data.npz")
        np.savez(path, **make_data(TINY))
        worker.request("setup", spec={"library": "qkvnp", "task": "train", "config": list(TINY),
                                      "data": path, "threads": None})
        profile = worker.request("profile", steps=2)
    finally:
        worker.close()
    shares = [share for _, share in profile["top"]]
    assert profile["steps"] == 2 and len(shares) > 0
    assert all(0 <= share <= 1 for share in shares) and sum(shares) <= 1 + 1e-9
    assert shares == sorted(shares, reverse=True)
    assert not any("marshal" in name or "compile" in name for name, _ in profile["top"])


def test_doctests_of_the_gpt_benchmark_modules():
    # benchmarks/ is outside pytest's testpaths: the loss check and the
    # products' count by hand run here
    import subprocess

    benchmarks = os.path.dirname(os.path.abspath(gpt_compare.__file__))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--doctest-modules", os.path.join(benchmarks, "gpt_compare.py"),
                           os.path.join(benchmarks, "workloads", "gpt.py"),
                           os.path.join(benchmarks, "rivals", "gpt_torch.py")],
                          cwd=os.path.dirname(benchmarks), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout, done.stdout


def test_products_floor_at_one_thread_is_the_one_thread_time(monkeypatch):
    # oracle: by hand: at --threads 1 nothing runs beside the products, so
    # their one-thread time is the floor; otherwise two cores may halve it
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    times = {"seconds": 3.0, "one_thread_seconds": 4.0}
    assert gpt_compare._products_floor(times, threads=1) == 3.0
    assert gpt_compare._products_floor(dict(times, seconds=5.0), threads=1) == 4.0
    assert gpt_compare._products_floor(times, threads=None) == 2.0


def test_a_missed_target_prints_the_one_core_budget_and_the_hand_off():
    # oracle: the arithmetic by hand: torch 15 ms at a 1.5x target allows 10 ms;
    # products 6 ms on one thread leave 4 ms for the rest, which takes 12 - 6 = 6 ms
    record = {"target": 1.5, "torch": {"ms": 15.0}, "qkvnp": {"ms": 12.0},
              "products": {"one_thread_ms": 6.0, "calls": 60, "handoff_us": 55.0}}
    budget, handoff = gpt_compare._budget_lines(record)
    assert "target's 10 ms step" in budget and "(6 ms) and 4 ms for the rest" in budget
    assert "takes 6 ms now" in budget
    assert "costs 55 us here" in handoff and "100 us per product call" in handoff
    assert gpt_compare._budget_lines(dict(record, torch=None)) == []
