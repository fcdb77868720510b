"""Tests of the Qwen3-like decoder's benchmark (benchmarks/families_bench.py): untimed, a tiny config.

Oracles: the command's own cross-checks (transformers' greedy tokens and
first losses from the same weights) decide its exit status; its JSON report
holds a row per task with qkvnp's rates, and transformers' when installed.
"""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                os.pardir, os.pardir)))
from benchmarks import families_bench  # noqa: E402

TINY_ARGS = ["--tiny", "--threads", "1", "--repeats", "1", "--warmup", "0", "--pause", "0",
             "--round-time", "0.001"]


def _has_transformers():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def test_tiny_run_agrees_and_reports(tmp_path, capsys):
    path = tmp_path / "families.json"
    assert families_bench.main(TINY_ARGS + ["--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert [row["task"] for row in report["rows"]] == ["decode", "train"]
    for row in report["rows"]:
        assert row["qkvnp"]["per_s"] > 0
        if _has_transformers():
            assert row["agree"] and row["torch"]["per_s"] > 0 and row["ratio"] > 0
        else:
            assert "missing" in row and "ratio" not in row
    train = report["rows"][1]
    assert train["qkvnp"]["products_ms"] > 0 and train["qkvnp"]["core_ms"] > 0
    assert train["qkvnp"]["step_ms"] > 0 and "rest_ms" in train["qkvnp"]
    if _has_transformers():  # the ceiling: torch's step over qkvnp's with torch's parts
        mine, theirs = train["qkvnp"], train["torch"]
        held = (mine["step_ms"] - mine["products_ms"] + theirs["products_ms"]
                - mine["core_ms"] + theirs["core_ms"])
        assert np.isclose(train["ceiling_ratio"], theirs["step_ms"] / held)
    assert "decode" in capsys.readouterr().out


def test_parts_are_interleaved_medians(monkeypatch):
    """Oracle: the definition, on stand-in timers: each round times a step, then the
    products and the cores once; the medians of each and of the round-by-round rest."""
    from benchmarks.workloads import families

    clock = iter(np.arange(0.0, 100.0, 1.0))  # a step takes 1 s on the stand-in clock
    monkeypatch.setattr(families.time, "perf_counter", lambda: float(next(clock)))
    products, cores = iter([0.2, 0.3, 0.4]), iter([0.05, 0.1, 0.15])
    monkeypatch.setattr(families, "time_products", lambda *a, **k: next(products))
    monkeypatch.setattr(families, "time_core", lambda *a, **k: next(cores))

    class Runner:
        library = "qkvnp"

        def call(self):
            return 0.0

    parts = families.time_parts(Runner(), families.TINY, 3)
    assert parts == {"step": 1.0, "products": 0.3, "core": 0.1, "rest": 0.6}


def test_split_costs_follow_their_definition(monkeypatch):
    """Oracle: the definition, on stand-in clocks and a serial stand-in for the kernel's
    ``run``: per call the slowest share's wall time less the fastest's, and less its own
    CPU time, summed over the step's two calls; medians over the rounds; ``run`` restored."""
    from benchmarks.workloads import families
    from qkvnp.kernels import decoder_train

    def serial_run(task, work, flops=None):
        for part in work:
            task(part)

    monkeypatch.setattr(decoder_train, "run", serial_run)
    # each share reads wall, CPU, then wall, CPU: (wall, CPU) spans per share, call, round
    spans = [[((1.0, 0.9), (3.0, 2.5)), ((2.0, 2.0), (1.5, 1.0))]] * 3
    walls, cpus = [], []
    for round_ in spans:
        for call in round_:
            for wall, cpu in call:
                walls += [0.0, wall]
                cpus += [0.0, cpu]
    wall_clock, cpu_clock = iter(walls), iter(cpus)
    monkeypatch.setattr(families.time, "perf_counter", lambda: next(wall_clock))
    monkeypatch.setattr(families.time, "thread_time", lambda: next(cpu_clock))

    class Runner:
        def call(self):  # the forward's call of run, then the backward's
            for _ in range(2):
                decoder_train.run(lambda part: None, [[0], [1]])

    split = families.time_split(Runner(), 3)
    # forward: slowest 3.0 (CPU 2.5), fastest 1.0; backward: slowest 2.0 (CPU 2.0), fastest 1.5
    assert split == {"imbalance": 2.0 + 0.5, "off_cpu": 0.5 + 0.0, "shares": 2}
    assert decoder_train.run is serial_run


def test_split_costs_of_a_real_split_step():
    """A tiny qkvnp runner at two threads with the split forced: two shares timed, the
    wait for the slowest not negative, the kernel's ``run`` put back."""
    from benchmarks.workloads import families
    from qkvnp.kernels import block_sizes, decoder_train

    real = decoder_train.run
    runner = families.make_runner("qkvnp", "train", families.TINY, threads=2)
    try:
        with block_sizes(batch_split_flops=0):
            split = families.time_split(runner, 2)
    finally:
        runner.pinned.close()  # the runner's thread counts, held for a worker's life
    assert split["shares"] == 2 and split["imbalance"] >= 0
    assert decoder_train.run is real


def test_split_costs_of_a_step_without_fused_blocks(monkeypatch):
    """A step that never calls the kernel's ``run`` (the layers' path): no shares, no cost."""
    from benchmarks.workloads import families

    class Runner:
        def call(self):
            return 0.0

    assert families.time_split(Runner(), 2) == {"imbalance": 0.0, "off_cpu": 0.0, "shares": 0}


def test_split_line_in_the_report():
    report = {"environment": {}, "config": {}, "rows": [
        {"task": "train", "threads": 2, "qkvnp": {"per_s": 1.0, "times_ms": [1.0],
                                                   "split_shares": 2, "imbalance_ms": 3.0,
                                                   "off_cpu_ms": 0.5}}]}
    assert ("        qkvnp's batch split in 2 shares, a step: 3.0 ms waiting for the slowest "
            "share, which spent 0.5 ms off its CPU (the GIL, the host)"
            in families_bench.format_report(report).splitlines())


def test_ceiling_lines_without_torch():
    """Oracle: the line's text, qkvnp's parts only when torch's side is missing."""
    lines = families_bench._ceiling_lines({"products_ms": 2.0, "core_ms": 1.0}, None, None)
    assert lines == ["        products alone 2.0 ms, attention cores alone 1.0 ms "
                     "(numpy, same threads)"]


def test_step_products_count():
    from benchmarks.workloads.families import QWEN3, step_products

    # 7 linears a layer and the head, 3 products each; 6 core products a layer
    assert len(step_products(QWEN3)) == 3 * (7 * 4 + 1) + 6 * 4
    assert step_products(QWEN3)[-3 * 0 - 1][0] == (8, 4, 128, 128)


def test_check_refuses_disagreement():
    assert families_bench.check_outputs("decode", {"qkvnp": [1, 2], "torch": [1, 3]}) == (1.0, False)
    error, agree = families_bench.check_outputs("train", {"qkvnp": [2.0, 1.0], "torch": [2.0, 1.5]})
    assert not agree and error == pytest.approx(1 / 3)
