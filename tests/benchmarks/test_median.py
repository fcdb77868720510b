"""Tests of the median of several benchmark runs (benchmarks/median.py); no benchmark runs.

Oracles: medians worked out by hand from small hand-made reports in the
schema of ``bench.run_benchmark`` (benchmarks/harness/bench.py); the summary of a single hand-made report
holding those medians (what the median report must read as); the file names
and measurements each refusal must name.
"""
import doctest
import json
import os
import re
import subprocess
import sys

import pytest

# as test_bench.py: the harness is imported from the checkout's benchmarks/
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                os.pardir, os.pardir)))
from benchmarks import median  # noqa: E402  (benchmarks/median.py)
from benchmarks.harness import machine  # noqa: E402
from benchmarks.reports import summary  # noqa: E402
from benchmarks.reports.report import read_json  # noqa: E402

SMALL, SMALL2, LONG = (1, 6, 3, 1), (8, 16, 32, 4), (1, 2048, 512, 8)


def make_report(layer, training=None, memory=None, import_ratio=None, date="2026-11-23 05:00:00",
                commit="abc1234"):
    """A report of ``python benchmarks/run.py --json`` holding only the given numbers.

    ``layer``: {(config, dtype, mask): ratio}; ``training``: {(task, dtype):
    (qkvnp steps/s, torch steps/s)}; ``memory``: {(config, dtype): (auto MiB,
    torch MiB)}; the records look like bench.py's (the torch record of each
    shape too, which the medians must ignore).
    """
    records = []
    for (config, dtype, mask), ratio in layer.items():
        for impl, value in (("auto", ratio), ("torch", 1.0)):
            records.append({"kind": "layer", "config": list(config), "dtype": dtype, "mask": mask,
                            "impl": impl, "status": "ok", "memory": None,
                            "fwd_bwd": {"ratio_torch": value, "flops": 1000 * config[1],
                                        "median_ms": 1.0}})
    for (config, dtype), mibs in (memory or {}).items():
        for impl, mib in zip(("auto", "torch"), mibs):
            records.append({"kind": "layer", "config": list(config), "dtype": dtype,
                            "mask": "none", "impl": impl, "status": "ok", "fwd_bwd": None,
                            "memory": {"rss_mib": mib, "method": "rss"}})
    tasks = [{"task": task, "dtype": dtype, "status": "ok", "reason": None,
              "qkvnp": {"steps_per_s": ours}, "torch": {"steps_per_s": theirs},
              "speedup": ours / theirs} for (task, dtype), (ours, theirs) in (training or {}).items()]
    imports = None if import_ratio is None else {"ratio": import_ratio, "numpy_ms": 50.0,
                                                 "qkvnp_ms": 50.0 * import_ratio, "repeats": 7}
    return {"environment": {"date_utc": date, "commit": commit}, "settings": {"repeats": 7},
            "import_time": imports, "records": records, "training": tasks, "summary": []}


def three_runs():
    """Three runs whose medians are worked out by hand in the comments."""
    layer = [{(SMALL, "float32", "none"): 0.5, (SMALL2, "float64", "causal"): 0.4,
              (LONG, "float32", "none"): 1.1},
             {(SMALL, "float32", "none"): 0.9, (SMALL2, "float64", "causal"): 0.3,
              (LONG, "float32", "none"): 1.3},
             {(SMALL, "float32", "none"): 0.45, (SMALL2, "float64", "causal"): 0.7,
              (LONG, "float32", "none"): 0.8}]
    # medians 0.5, 0.4, 1.1
    training = [{("teacher", "float64"): (600.0, 300.0)},   # speedup 2.0
                {("teacher", "float64"): (700.0, 500.0)},   # 1.4
                {("teacher", "float64"): (500.0, 200.0)}]   # 2.5; medians 600, 300, 2.0
    memory = [{(LONG, "float32"): (10.0, 20.0)},   # 0.5
              {(LONG, "float32"): (12.0, 18.0)},   # 0.667
              {(LONG, "float32"): (30.0, 25.0)}]   # 1.2; medians 12, 20, 0.667
    imports = [1.1, 1.0, 1.3]  # median 1.1
    return [make_report(layer[i], training[i], memory[i], imports[i],
                        date=f"2026-11-23 0{5 + i}:00:00", commit=f"c0mmit{i}")
            for i in range(3)]


def write_runs(tmp_path, reports):
    paths = []
    for number, report in enumerate(reports, 1):
        paths.append(str(tmp_path / f"run{number}.json"))
        with open(paths[-1], "w") as stream:
            json.dump(report, stream)
    return paths


def medians_by_name(report):
    return {(m["kind"], m["measurement"]): (m["median"], m["runs"]) for m in report["medians"]}


# ---------------------------------------------------------------- the median


@pytest.mark.parametrize("values, expected", [
    ([2.0], 2.0),                    # one run: its value
    ([3.0, 1.0, 2.0], 2.0),          # odd: the middle value, in any order
    ([0.9, 0.45, 0.5], 0.5),
    ([1.0, 9.0, 4.0, 100.0], 6.0),   # even: geometric mean of the middle two, sqrt(4 * 9)
    ([2.0, 8.0], 4.0),
])
def test_median_by_hand(values, expected):
    assert median.median(values) == pytest.approx(expected, rel=1e-15)


def test_even_median_of_inverses_is_the_inverse():
    # oracle: qkvnp/PyTorch and PyTorch/qkvnp must tell the same story
    values = [0.5, 0.8, 1.25, 3.0]
    assert median.median([1 / v for v in values]) == pytest.approx(1 / median.median(values),
                                                                   rel=1e-15)
    with pytest.raises(ValueError, match="no values"):
        median.median([])


def test_doctests():
    result = doctest.testmod(median)  # benchmarks/ is outside pytest's doctest paths
    assert result.failed == 0 and result.attempted == 2


def test_medians_of_three_runs_with_each_runs_value():
    reports = three_runs()
    paths = ["a.json", "b.json", "c.json"]
    report = median.median_report(reports, paths, median.combine(reports, paths))
    found = medians_by_name(report)
    assert found[("layer", "(1, 6, 3, 1) float32")] == (0.5, [0.5, 0.9, 0.45])
    assert found[("layer", "(8, 16, 32, 4) float64 causal")] == (0.4, [0.4, 0.3, 0.7])
    assert found[("layer", "(1, 2048, 512, 8) float32")] == (1.1, [1.1, 1.3, 0.8])
    assert found[("training", "teacher float64")] == (2.0, [2.0, 1.4, 2.5])
    assert found[("memory", "(1, 2048, 512, 8) float32")][0] == pytest.approx(12 / 18)
    assert found[("import", "import qkvnp / import numpy")] == (1.1, [1.1, 1.0, 1.3])
    assert len(found) == 6  # no entry for the torch records or the absolute numbers
    assert report["import_time"] == {"ratio": 1.1}
    assert [run["commit"] for run in report["runs"]] == ["c0mmit0", "c0mmit1", "c0mmit2"]


def test_even_count_of_runs_in_a_report():
    # oracle: with four runs, sqrt of the product of the middle two
    reports = three_runs() + [make_report({(SMALL, "float32", "none"): 0.6,
                                           (SMALL2, "float64", "causal"): 0.4,
                                           (LONG, "float32", "none"): 1.2},
                                          {("teacher", "float64"): (400.0, 400.0)},
                                          {(LONG, "float32"): (20.0, 20.0)}, 1.2)]
    report = median.median_report(reports, list("abcd"), median.combine(reports, list("abcd")))
    found = medians_by_name(report)
    assert found[("layer", "(1, 6, 3, 1) float32")][0] == pytest.approx((0.5 * 0.6) ** 0.5)
    assert found[("layer", "(1, 2048, 512, 8) float32")][0] == pytest.approx((1.1 * 1.2) ** 0.5)
    assert found[("training", "teacher float64")][0] == pytest.approx((1.4 * 2.0) ** 0.5)


# ---------------------------------------------------------------- what the user reads


def test_summary_sentences_are_those_of_a_run_with_the_medians():
    # oracle: summary.summarize of one hand-made report holding the medians
    reports = three_runs()
    report = median.median_report(reports, list("abc"), median.combine(reports, list("abc")))
    expected = make_report({(SMALL, "float32", "none"): 0.5, (SMALL2, "float64", "causal"): 0.4,
                            (LONG, "float32", "none"): 1.1}, {("teacher", "float64"): (600.0, 300.0)},
                           {(LONG, "float32"): (12.0, 20.0)})
    assert report["summary"] == summary.summarize(expected)
    assert summary.ratio_table(report) == summary.ratio_table(expected)
    text = "\n".join(report["summary"])
    # no run measured these: 0.5 and 0.4 come from different runs
    assert "small shapes (B*L*E <= 16,384: (1, 6, 3, 1), (8, 16, 32, 4)): qkvnp is 2.2x faster" in text
    assert "L = 2048 ((1, 2048, 512, 8)): qkvnp is 1.1x slower than PyTorch." in text
    assert "qkvnp 12 MiB, PyTorch 20 MiB" in text
    assert "teacher float64: qkvnp 600 steps/s, PyTorch 300 steps/s: qkvnp is 2.0x faster" in text


def test_command_prints_runs_spread_and_summary_without_targets(tmp_path, capsys):
    paths = write_runs(tmp_path, three_runs())
    out_json = tmp_path / "median.json"
    assert median.main(paths + ["--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Median of 3 runs of python benchmarks/run.py:\n")
    assert f"run 2: {paths[1]}, started 2026-11-23 06:00:00 UTC, commit c0mmit1" in out
    assert "note: the runs measured different commits" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("(1, 6, 3, 1) float32"))
    assert row.split()[-4:] == ["0.50", "0.50", "0.90", "0.45"]  # median, then each run
    assert "Summary (medians of 3 runs)" in out and "qkvnp is 2.2x faster" in out
    lowered = out.lower()
    assert "target" not in lowered and "issue" not in lowered and not re.search(r"#\s*\d", out)
    written = read_json(out_json)
    assert written["median_of"] == 3 and written["summary"] == median.median_report(
        three_runs(), paths, median.combine(three_runs(), paths))["summary"]
    assert sorted(os.listdir(tmp_path)) == ["median.json", "run1.json", "run2.json", "run3.json"]


def test_plot_draws_the_medians(monkeypatch, tmp_path):
    drawn = {}
    monkeypatch.setattr(median, "plot_ratios",
                        lambda report, path: drawn.update(rows=summary.default_path_ratios(report)))
    median.main(write_runs(tmp_path, three_runs()) + ["--plot", str(tmp_path / "ratio.png")])
    assert sorted(row[3] for row in drawn["rows"]) == [0.4, 0.5, 1.1]


def test_runs_as_a_script(tmp_path):
    # the file itself, as the README shows it: benchmarks/ and the checkout on the path
    script = os.path.join(os.path.dirname(os.path.abspath(median.__file__)), "median.py")
    done = subprocess.run([sys.executable, script] + write_runs(tmp_path, three_runs()),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "Summary (medians of 3 runs)" in done.stdout


# ---------------------------------------------------------------- refusals


def test_runs_that_measured_different_things_are_refused_by_name(tmp_path, capsys):
    reports = three_runs()
    del reports[1]["records"][0:2]  # run2 lacks (1, 6, 3, 1) float32 (auto and torch)
    reports[2]["import_time"] = None  # run3 was started without the import timing
    paths = write_runs(tmp_path, reports)
    with pytest.raises(ValueError) as refused:
        median.combine(reports, paths)
    message = str(refused.value)
    assert "did not measure the same things" in message
    assert f"{paths[1]} lacks layer (1, 6, 3, 1) float32;" in message
    assert f"{paths[2]} lacks import time import qkvnp / import numpy" in message
    assert paths[0] not in message
    with pytest.raises(SystemExit):
        median.main(paths)
    assert f"{paths[1]} lacks layer (1, 6, 3, 1) float32" in capsys.readouterr().err


def test_the_same_file_twice_is_refused(tmp_path, capsys):
    # oracle: one run given twice would make a median of agreeing "runs"
    paths = write_runs(tmp_path, three_runs()[:2])
    again = os.path.join(str(tmp_path), os.pardir, tmp_path.name, "run1.json")  # another spelling
    with pytest.raises(SystemExit):
        median.main(paths + [again])
    assert f"{again} is given twice" in capsys.readouterr().err


def test_a_long_list_of_missing_measurements_is_cut():
    # seven measurements missing: four named, then how many more
    full = make_report({((1, L, 8, 2), "float32", "none"): 0.5 for L in range(1, 8)})
    with pytest.raises(ValueError, match=r"b lacks layer \(1, 1, 8, 2\) float32, .* and 3 more$"):
        median.combine([full, make_report({})], ["a", "b"])


@pytest.mark.parametrize("content, expected", [
    ("not json", "not JSON"),
    ("[1, 2]", "it has no 'environment', 'settings', 'records'"),
    ('{"records": []}', "it has no 'environment', 'settings'"),
    ('{"environment": {}, "settings": {}, "records": {}}', "list of 'records'"),
])
def test_files_that_are_not_reports_are_refused_by_name(tmp_path, capsys, content, expected):
    path = tmp_path / "other.json"
    path.write_text(content)
    with pytest.raises(ValueError) as refused:
        median.load_report(str(path))
    assert str(path) in str(refused.value) and expected in str(refused.value)
    good = write_runs(tmp_path, three_runs()[:1])
    with pytest.raises(SystemExit):
        median.main(good + [str(path)])
    assert str(path) in capsys.readouterr().err


def test_the_median_report_is_not_taken_for_a_run(tmp_path, capsys):
    # its own --json output lacks the environment and settings of a run
    paths = write_runs(tmp_path, three_runs())
    median.main(paths + ["--json", str(tmp_path / "median.json")])
    with pytest.raises(ValueError, match="median.json is not a report of python benchmarks/run.py"):
        median.load_report(str(tmp_path / "median.json"))


def test_commit_of_the_checkout_is_recorded(monkeypatch, tmp_path):
    # oracle: git's own hash of a throw-away repository's commit, then "-dirty"
    # once a tracked file changes; outside a git checkout (a wheel): None
    monkeypatch.setattr(machine, "CHILD_PATH", [machine.CHILD_PATH[0], str(tmp_path)])
    assert machine.checkout_commit() is None
    assert "commit" in machine.environment_info()

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    try:
        git("init", "-q")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("git is not available")
    (tmp_path / "file.txt").write_text("one")
    git("add", "file.txt")
    git("commit", "-q", "-m", "one")
    head = git("rev-parse", "HEAD").strip()
    commit = machine.checkout_commit()
    assert commit and head.startswith(commit)
    (tmp_path / "file.txt").write_text("two")
    assert machine.checkout_commit() == commit + "-dirty"
