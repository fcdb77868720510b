"""Tests of the benchmark harness (benchmarks/): fast, and no wall-clock assertions.

Oracles: FLOPs counted independently from the list of matmuls each workload
runs; the cross-check against known perturbations (a wrong gradient must be
refused, rounding-level noise accepted); a JSON file read back equal to what
was written; the command's exit status and output on a tiny configuration.
"""
import ast
import json
import os
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest

from qkvnp.kernels.openblas import openblas_thread_functions

# The harness lives beside the package (the wheel does not ship it): import
# the checkout's benchmarks package, as benchmarks/run.py does. (Not in a
# tests/benchmarks/conftest.py: two conftest.py files outside packages clash
# under --doctest-modules.)
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                os.pardir, os.pardir)))
from benchmarks import run  # noqa: E402  (benchmarks/run.py: the command line)
from benchmarks.harness import (bench, crosscheck, import_cost, machine, memory,  # noqa: E402
                                timing)
from benchmarks.reports.report import (format_report, plot_results, read_json,  # noqa: E402
                                       target_lines, target_requirements, write_json)
from benchmarks.workloads import attention, grid  # noqa: E402
from benchmarks.workloads.grid import Config  # noqa: E402

BENCHMARKS_DIR = os.path.dirname(os.path.abspath(run.__file__))
CHECKOUT = os.path.dirname(BENCHMARKS_DIR)

TINY = Config(1, 16, 16, 2)
TINY_ARGS = ["--configs", "1,16,16,2", "--repeats", "1", "--no-memory",
             "--import-repeats", "0", "--pause", "0", "--gemm-size", "128",
             "--round-time", "0.001", "--no-training"]


def matmul_flops(shapes):
    """2*m*k*n summed over matmuls given as (count, m, k, n)."""
    return sum(2 * count * m * k * n for count, m, k, n in shapes)


# ---------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("config", [
    Config(8, 128, 256, 8),   # the issue's short-sequence configuration
    Config(1, 4096, 256, 4),  # long sequence: the L*L terms dominate
    Config(3, 5, 6, 3),       # odd sizes
])
def test_flops_match_an_explicit_list_of_matmuls(config):
    # oracle: every matmul of the forward written out with its shape
    B, L, E, H = config
    D = E // H
    projections = [(4, B * L, E, E)]          # Q, K, V and out: (B*L, E) @ (E, E)
    core = [(B * H, L, D, L), (B * H, L, L, D)]  # Q K^T and P V per (batch, head)
    assert grid.core_flops(config) == matmul_flops(core)
    assert grid.layer_flops(config) == matmul_flops(projections + core)
    # backward: each (m, k) @ (k, n) needs (m, n) @ (n, k) and (k, m) @ (m, n)
    backward = [(c, m, n, k) for c, m, k, n in projections + core] + \
               [(c, k, m, n) for c, m, k, n in projections + core]
    assert grid.layer_flops(config, backward=True) == matmul_flops(projections + core + backward)
    assert grid.core_flops(config, backward=True) == 3 * matmul_flops(core)


def test_flops_of_the_issue_configuration_by_hand():
    # (8, 128, 256, 8): 8*8*128*256^2 + 4*8*128^2*256
    assert grid.layer_flops(Config(8, 128, 256, 8)) == 536_870_912 + 134_217_728


# ---------------------------------------------------------------- cross-check


class Perturbed:
    """A runner that returns another runner's results with one array changed."""

    library = "qkvnp"

    def __init__(self, runner, name, change):
        self.runner, self.name, self.change = runner, name, change

    def forward(self):
        return self.runner.forward()

    def forward_backward(self):
        return self.runner.forward_backward()

    def result(self):
        results = self.runner.result()
        results[self.name] = self.change(results[self.name])
        return results


@pytest.mark.parametrize("kind", ["layer", "core"])
def test_reference_agrees_with_itself(kind):
    # oracle: the same code on the same inputs gives identical arrays
    problem = attention.make_problem(kind, TINY, "float64")
    runner = attention.make_runner("reference", problem)
    check = crosscheck.cross_check(runner.result(), runner.result(), "float64")
    assert check.ok and check.error == 0.0


@pytest.mark.parametrize("dtype, relative, accepted", [
    ("float64", 1e-13, True),   # rounding-level difference (a tenth of the 1e-12 tolerance)
    ("float64", 1e-8, False),   # a real error in float64
    ("float32", 1e-6, True),    # float32 rounding
    ("float32", 1e-3, False),   # a real error in float32
])
def test_cross_check_tolerance_by_dtype(dtype, relative, accepted):
    problem = attention.make_problem("core", TINY, dtype)
    runner = attention.make_runner("reference", problem)
    expected = runner.result()
    results = dict(expected)
    results["dkey"] = expected["dkey"] * (1 + relative)
    check = crosscheck.cross_check(results, expected, dtype)
    assert check.ok is accepted, check
    assert check.worst == "dkey"


@pytest.mark.parametrize("change, why", [
    (lambda a: a[..., :-1], "wrong shape"),
    (lambda a: np.where(a == a.flat[0], np.nan, a), "NaN"),
    (lambda a: -a, "wrong sign"),
])
def test_cross_check_refuses_broken_arrays(change, why):
    problem = attention.make_problem("core", TINY, "float64")
    expected = attention.make_runner("reference", problem).result()
    results = dict(expected, dvalue=change(expected["dvalue"]))
    assert not crosscheck.cross_check(results, expected, "float64").ok, why
    del results["dvalue"]
    assert not crosscheck.cross_check(results, expected, "float64").ok, "missing array"


def test_wrong_implementation_is_refused_and_not_timed(monkeypatch, tmp_path):
    # a "fast" path whose dquery is 0.1% off and a "tiled" one that returns
    # NaN must get no timing, and their records must still be valid JSON
    make_runner = attention.make_runner
    wrong = {"fast": lambda a: a * 1.001, "tiled": lambda a: a * np.nan}

    def with_wrong_paths(impl, problem):
        runner = make_runner("reference" if impl in wrong else impl, problem)
        return Perturbed(runner, "dquery", wrong[impl]) if impl in wrong else runner

    monkeypatch.setattr(bench, "make_runner", with_wrong_paths)
    records = bench.run_case("core", TINY, np.dtype("float64"), ("reference", "fast", "tiled"),
                              repeats=1, warmup=0, pause=0.0)
    by_impl = {r["impl"]: r for r in records}
    for impl in wrong:
        assert by_impl[impl]["status"] == "refused"
        assert "dquery" in by_impl[impl]["reason"]
        assert by_impl[impl]["fwd"] is None and by_impl[impl]["fwd_bwd"] is None
    assert by_impl["tiled"]["check"]["max_rel_err"] is None  # inf is not JSON
    assert write_json(tmp_path / "r.json", {"records": records})["records"] == records
    assert by_impl["reference"]["status"] == "ok"
    assert len(by_impl["reference"]["fwd_bwd"]["times_ms"]) == 1


def test_missing_implementation_is_reported_not_raised(monkeypatch):
    monkeypatch.setitem(attention.CORE_MODULES, "fast", "qkvnp._no_such_module")
    records = bench.run_case("core", TINY, np.dtype("float32"), ("reference", "fast"),
                              repeats=1, warmup=0, pause=0.0)
    fast = next(r for r in records if r["impl"] == "fast")
    assert fast["status"] == "missing" and "qkvnp._no_such_module" in fast["reason"]
    problem = attention.make_problem("layer", TINY, "float32")
    with pytest.raises(attention.ImplementationMissing):
        attention._QkvnpLayer("no-such-impl", problem)


@pytest.mark.parametrize("kind", ["layer", "core"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_pytorch_computes_the_same_function(torch, kind, dtype):
    # oracle: the reference path; checks that the weights are copied across
    # with the right transposes and that db_key (zero in exact arithmetic) is
    # judged on the bias gradients' scale
    problem = attention.make_problem(kind, TINY, dtype)
    expected = attention.make_runner("reference", problem).result()
    check = crosscheck.cross_check(attention.make_runner("torch", problem).result(), expected, dtype)
    assert check.ok, check


def test_timing_interleaves_and_pauses_between_implementations(monkeypatch):
    # oracle: a log of calls and sleeps, with a fake clock-free runner. Two
    # qkvnp implementations are separated by a pause too: OpenBLAS threads
    # that one leaves spinning slow the next (see time_interleaved's NOTE).
    log = []

    class Fake:
        def __init__(self, name, library):
            self.name, self.library = name, library

        def forward(self):
            log.append(self.name)

    monkeypatch.setattr(timing.time, "sleep", lambda seconds: log.append("sleep"))
    runners = {"a": Fake("a", "qkvnp"), "b": Fake("b", "qkvnp"), "t": Fake("t", "torch")}
    times = timing.time_interleaved(runners, "fwd", repeats=3, warmup=1, pause=0.5)
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3, "t": 3}
    assert log == ["a", "sleep", "b", "sleep", "t",                    # warm-up
                   "sleep", "b", "sleep", "t", "sleep", "a",           # rounds rotate their start
                   "sleep", "t", "sleep", "a", "sleep", "b",
                   "sleep", "a", "sleep", "b", "sleep", "t"]
    # one implementation alone never pauses; pause=0 never sleeps
    log.clear()
    timing.time_interleaved({"a": runners["a"]}, "fwd", repeats=2, warmup=1, pause=0.5)
    timing.time_interleaved(runners, "fwd", repeats=1, warmup=0, pause=0)
    assert log == ["a", "a", "a", "a", "b", "t"]


# ---------------------------------------------------------------- JSON and output


def test_json_round_trip_is_atomic(tmp_path):
    path = tmp_path / "results.json"
    report = {"records": [{"impl": "fast", "fwd": {"median_ms": 1.5, "times_ms": [1.5, 2.0]},
                           "memory": None}], "gemm_peak_gflops": {"float32": np.float64(200.0)}}
    assert write_json(path, report) == json.loads(json.dumps(report, default=float))
    with pytest.raises(ValueError):  # NaN is not JSON: the old file must survive intact
        write_json(path, {"bad": float("nan")})
    assert read_json(path)["gemm_peak_gflops"] == {"float32": 200.0}
    assert os.listdir(tmp_path) == ["results.json"]  # no temporary file left behind


def test_command_on_a_tiny_config(tmp_path, capsys):
    # oracle: exit status 0 (every implementation present agreed with the
    # reference path), one table row per implementation, the JSON file
    path = tmp_path / "bench.json"
    # every workload and implementation asked for: at L <= 128 the default is
    # the layer's auto path and PyTorch only
    status = run.main(TINY_ARGS + ["--json", str(path), "--kinds", "layer", "core",
                                     "--impls", *grid.IMPLEMENTATIONS])
    out = capsys.readouterr().out
    assert status == 0, out
    report = read_json(path)
    assert report["settings"]["configs"] == [[1, 16, 16, 2]]
    assert {(r["kind"], r["dtype"], r["impl"]) for r in report["records"]} == {
        (k, d, i) for k in grid.KINDS for d in ("float32", "float64")
        for i in grid.KIND_IMPLEMENTATIONS[k]}
    assert "auto" in grid.KIND_IMPLEMENTATIONS["layer"] and "auto" not in grid.KIND_IMPLEMENTATIONS["core"]
    for record in report["records"]:
        assert record["status"] in ("ok", "missing"), record
        if record["status"] == "ok":
            assert len(record["fwd_bwd"]["times_ms"]) == 1
    assert "GEMM peak" in out and "OPENBLAS_CORETYPE=" in out
    # one row per record; without PyTorch its rows give way to one line
    shown = [r for r in report["records"] if r["impl"] != "torch" or r["status"] != "missing"]
    assert out.count("(1,16,16,2)") == len(shown)
    assert (len(shown) < len(report["records"])) == (attention.TORCH_MISSING in out)


def test_command_through_run_py(capsys):
    # the command is benchmarks/run.py (python -m qkvnp bench is gone)
    status = run.main(TINY_ARGS + ["--kinds", "core", "--dtypes", "float64"])
    assert status == 0
    assert "attention core" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--configs", "1,16,15,2"], "E divisible by H"),
    (["--configs", "1,16,16"], "four integers"),
    (["--repeats", "0"], ">= 1"),
    (["--pause", "-1"], "seconds >= 0"),
])
def test_bad_options_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        run.main(argv)
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if absent
    assert plot_results({"records": []}, tmp_path / "plot.png") is False
    assert "pip install 'qkvnp[plot]'" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_plot_draws_every_series_and_writes_atomically(monkeypatch, tmp_path):
    # matplotlib is optional and absent here: a recording stand-in checks what
    # would be drawn (oracle: one time series and one memory series per
    # implementation and dtype, x = L) and that the file appears atomically
    import types

    axes = np.empty((1, 2), dtype=object)  # what subplots(1, 2, squeeze=False) returns
    axes[0, 0], axes[0, 1] = mock.MagicMock(), mock.MagicMock()
    figure = mock.MagicMock()
    figure.savefig.side_effect = lambda stream, format: stream.write(b"PNG " + format.encode())
    pyplot = types.SimpleNamespace(subplots=mock.MagicMock(return_value=(figure, axes)),
                                   close=mock.MagicMock())
    matplotlib = types.SimpleNamespace(use=lambda backend: None, pyplot=pyplot)
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)

    def record(L, impl, memory):
        return {"kind": "core", "config": [1, L, 16, 2], "dtype": "float32", "impl": impl,
                "status": "ok", "fwd_bwd": {"median_ms": L / 100}, "memory": memory}

    report = {"records": [record(512, "fast", {"rss_mib": 5.0}), record(128, "fast", {"rss_mib": 1.0}),
                          record(128, "torch", None),
                          dict(record(128, "tiled", None), status="missing")]}
    path = tmp_path / "plot.png"
    assert plot_results(report, path) is True
    assert path.read_bytes() == b"PNG png" and os.listdir(tmp_path) == ["plot.png"]
    time_axis, memory_axis = axes[0]
    drawn = {call.kwargs["label"]: call.args[:2] for call in time_axis.plot.call_args_list}
    assert drawn == {"fast float32": ([128, 512], [1.28, 5.12]), "torch float32": ([128], [1.28])}
    memory_calls = memory_axis.plot.call_args_list
    assert [(c.kwargs["label"], c.args[:2]) for c in memory_calls] == [
        ("fast float32", ((128, 512), (1.0, 5.0)))]
    pyplot.close.assert_called_once_with(figure)


def test_refused_rows_print_no_numbers():
    report = {"environment": machine.environment_info(), "gemm_peak_gflops": {"float64": 100.0},
              "settings": {"impls": ["reference", "fast"], "repeats": 7, "warmup": 1,
                           "pause_s": 0.3, "gemm_size": 2048},
              "import_time": None,
              "records": [{"kind": "core", "config": [1, 16, 16, 2], "dtype": "float64",
                           "impl": "fast", "status": "refused", "memory": None,
                           "reason": "disagrees with the reference path", "fwd": None,
                           "fwd_bwd": None}]}
    row = [line for line in format_report(report).splitlines() if "fast" in line][0]
    assert "REFUSED: disagrees" in row and not any(c.isdigit() for c in row.split("fast")[1])


def test_target_lines_name_the_worst_case():
    # oracle: hand-made ratios; one layer config at 0.9x misses the 0.8x target
    def record(kind, config, impl, ratio, percent):
        return {"kind": kind, "config": list(config), "dtype": "float32", "impl": impl,
                "status": "ok", "memory": None,
                "fwd_bwd": {"ratio_torch": ratio, "percent_peak": percent}}

    report = {"settings": {"impls": ["reference", "fast", "torch"]}, "tiled_memory": None,
              "import_time": {"ratio": 1.1},
              "records": [record("layer", (8, 128, 256, 8), "fast", 0.7, 50.0),
                          record("layer", (4, 512, 512, 8), "fast", 0.9, 80.0),
                          record("core", (4, 512, 512, 8), "fast", 0.95, 60.0),
                          record("core", (8, 128, 256, 8), "fast", 1.5, 10.0)]}
    lines = target_lines(report)
    assert ("  layer fwd+bwd <= 0.8x nn.MultiheadAttention: fast worst 0.90 at (4, 512, 512, 8) "
            "float32 (1/2 within) MISSED") in lines
    # the core target starts at L = 512: the 1.5x at L = 128 does not count
    assert any(line.startswith("  core fwd+bwd") and "0.95" in line and line.endswith(" ok")
               for line in lines)
    assert any("75% of GEMM peak" in line and "lowest 80%" in line and line.endswith(" ok")
               for line in lines)
    assert "  import qkvnp <= 1.25x import numpy: 1.10 ok" in lines


def test_target_requirements_by_hand():
    # oracle: hand arithmetic. Layer (4, 512, 512, 8) fwd+bwd matmul FLOPs:
    # 3 * (8*B*L*E*E + 4*B*L*L*E) = 3 * (4294967296 + 2147483648) = 19327352832;
    # at a 360 GFLOP/s peak that is 53.687 ms; the target is 0.8 x 92.3 ms = 73.84 ms,
    # so it needs 53.687 / 73.84 = 72.7% of the peak. The core at L = 128 has no target.
    def torch_record(kind, config, ms):
        return {"kind": kind, "config": list(config), "dtype": "float32", "impl": "torch",
                "status": "ok", "fwd_bwd": {"median_ms": ms}}

    report = {"gemm_peak_gflops": {"float32": 360.0},
              "attention_gemm_ceiling_gflops": {"float32": 270.0},
              "records": [torch_record("layer", (4, 512, 512, 8), 92.3),
                          torch_record("core", (8, 128, 256, 8), 14.6),
                          dict(torch_record("layer", (1, 2048, 512, 8), 1.0), impl="fast")]}
    (needs,) = target_requirements(report)
    assert needs["kind"] == "layer" and needs["config"] == (4, 512, 512, 8)
    assert needs["target_ms"] == pytest.approx(73.84)
    assert needs["floor_ms"] == pytest.approx(19327352832 / 360e6)
    assert needs["needed_percent"] == pytest.approx(100 * 53.68709120 / 73.84, rel=1e-9)
    assert needs["ceiling_percent"] == pytest.approx(75.0)
    # without a measured peak there is nothing to compare with
    assert target_requirements(dict(report, gemm_peak_gflops={})) == []


def test_attention_gemm_ceiling_is_a_rate():
    # oracle: none for the value (it is a timing); the call must run the fast
    # path's threads and return a positive finite GFLOP/s for each dtype
    for dtype in ("float32", "float64"):
        rate = machine.measure_attention_gemm_ceiling(dtype, length=64, head_dim=8, rounds=2, repeats=1)
        assert np.isfinite(rate) and rate > 0


# ---------------------------------------------------------------- memory and imports


def test_memory_child_sees_the_weights_matrix():
    # oracle: the reference core keeps the (L, L) float64 weights in its cache,
    # 8 MiB at L = 1024, so the peak extra memory is at least that
    measured = memory.measure_memory("core", "reference", Config(1, 1024, 16, 1), "float64")
    assert "error" not in measured, measured
    assert measured["rss_mib"] >= 8.0
    assert measured["tracemalloc_mib"] >= 8.0


def test_importing_qkvnp_and_the_harness_stays_light():
    # oracle: sys.modules of a fresh interpreter (issue 4 item 4): the command
    # line imports every module of the run, the worker processes worker_child
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import qkvnp, benchmarks.run, "
            "benchmarks.harness.worker_child, benchmarks.median; "
            "print(' '.join(m for m in ('scipy', 'torch', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, CHECKOUT], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == ""
    cost = import_cost.measure_import_time(repeats=1)
    assert cost["extra_modules"] == []
    assert cost["numpy_ms"] > 0 and cost["qkvnp_ms"] > 0


def harness_modules():
    """``{dotted module name: path}`` of every module of benchmarks/, its parts' folders too."""
    modules = {}
    for directory, subdirs, names in os.walk(BENCHMARKS_DIR):
        subdirs[:] = [name for name in subdirs if name != "__pycache__"]
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                parts = os.path.relpath(path, CHECKOUT)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts.pop()
                modules[".".join(parts)] = path
    return dict(sorted(modules.items()))


def test_doctests_of_the_harness():
    # benchmarks/ is outside pytest's testpaths (qkvnp, tests), so the harness's
    # doctests (FLOPs by hand, relative_error, the summary's phrases, the loss
    # check) run here, with the project's flags. Oracle for the count: the
    # docstrings holding an example, read with ast (one doctest item each)
    def with_examples(tree):
        nodes = [tree] + [node for node in tree.body if isinstance(node, (ast.FunctionDef,
                                                                          ast.ClassDef))]
        nodes += [member for node in tree.body if isinstance(node, ast.ClassDef)
                  for member in node.body if isinstance(member, ast.FunctionDef)]
        return sum(">>>" in (ast.get_docstring(node) or "") for node in nodes)

    paths = list(harness_modules().values())
    expected = 0
    for path in paths:
        with open(path, encoding="utf-8") as source:
            expected += with_examples(ast.parse(source.read()))
    assert expected >= 5  # grid, timing, crosscheck, summary, training
    checkout = CHECKOUT
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--doctest-modules", *paths],
                          cwd=checkout, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{expected} passed" in done.stdout, done.stdout


def test_harness_imports_one_way_in_modules_of_readable_size():
    # oracle: the import graph of benchmarks/ read with ast (imports inside
    # functions count), as tests/test_layout.py reads the package's
    modules = harness_modules()
    names = set(modules)
    graph = {}
    for name, path in modules.items():
        with open(path, encoding="utf-8") as source:
            text = source.read()
        lines = text.count("\n")
        assert lines <= 700, f"{path}: {lines} lines"
        tree = ast.parse(text)
        graph[name] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                graph[name] |= {alias.name for alias in node.names if alias.name in names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                assert node.module == "benchmarks" or not node.module.startswith("benchmarks") \
                    or node.module in names, f"{name} imports {node.module}, not a module here"
                for alias in node.names:
                    # from benchmarks.workloads import training: the module is the name
                    submodule = f"{node.module}.{alias.name}"
                    if submodule in names and submodule != name:
                        graph[name].add(submodule)
                    elif node.module in names and node.module not in ("benchmarks",):
                        graph[name].add(node.module)
                        assert not alias.name.startswith("_"), \
                            f"{name} imports private {node.module}.{alias.name}"

    def reaches(start, goal, seen=()):
        return any(after == goal or (after not in seen and reaches(after, goal, seen + (after,)))
                   for after in graph[start])

    cycles = sorted(name for name in names if reaches(name, name))
    assert not cycles, f"modules on an import cycle: {cycles}"
    # the command line sits on top, the grid at the bottom
    assert not any("benchmarks.run" in after for name, after in graph.items())
    assert graph["benchmarks.workloads.grid"] == set()
    # every module is in one of the parts, or a command at the top
    parts = ("harness", "workloads", "rivals", "reports")
    assert all(len(name.split(".")) <= 2 or name.split(".")[1] in parts for name in names)


def test_benchmarks_run_py_is_the_same_command():
    script = os.path.join(BENCHMARKS_DIR, "run.py")
    out = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "--quick" in out and "--no-memory" in out
    assert run.__doc__.splitlines()[0] in " ".join(out.split())  # help text rewraps lines


# ---------------------------------------------------------------- the grid and its protocols


def test_grid_holds_the_users_sizes_and_the_large_ones():
    # oracle: the shapes listed by hand
    users = [(1, 6, 3, 1), (8, 16, 32, 4), (64, 8, 16, 2), (16, 32, 64, 4), (64, 33, 64, 1),
             (32, 64, 128, 8)]
    large = [(8, 128, 256, 8), (4, 512, 512, 8), (1, 2048, 512, 8), (1, 4096, 256, 4)]
    assert [tuple(c) for c in grid.DEFAULT_CONFIGS] == users + large
    cases = grid.plan_cases(grid.DEFAULT_CONFIGS, ["float32", "float64"])
    layer = {(tuple(c.config), c.dtype.name, c.mask): c for c in cases if c.kind == "layer"}
    for config in users + large:  # each shape, dtype and mask has the default path and PyTorch
        for dtype in ("float32", "float64"):
            for mask in ("none", "causal"):
                case = layer[(config, dtype, mask)]
                assert {"auto", "torch"} <= set(case.impls)
                assert case.protocol == ("processes" if config[1] <= 128 else "same process")
    # the one-library-per-process cases run first (before any torch thread pool exists here)
    protocols = [c.protocol for c in cases]
    assert protocols == sorted(protocols, key=lambda p: p != "processes")


def test_quick_plan_is_the_users_view():
    cases = grid.plan_cases(grid.QUICK_CONFIGS, ["float32"], quick=True)
    assert {c.impls for c in cases} == {("auto", "torch")} and {c.kind for c in cases} == {"layer"}
    assert any(c.protocol == "same process" for c in cases)
    assert {c.mask for c in cases} == {"none", "causal"}


def test_off_grid_preset_times_the_layer_against_pytorch_only(monkeypatch):
    # oracle: the shapes listed by hand (BERT-base and GPT-2 small's attention,
    # lengths that are not powers of two), and what the help promises
    assert [tuple(c) for c in grid.OFF_GRID_CONFIGS] == [
        (1, 16, 768, 12), (4, 100, 64, 4), (1, 128, 768, 12), (8, 128, 768, 12),
        (32, 200, 64, 4), (2, 256, 768, 12), (1, 1000, 64, 1), (1, 1024, 768, 12)]

    class Planned(Exception):
        pass

    def run_benchmark(**kwargs):
        raise Planned(kwargs)

    monkeypatch.setattr(run, "run_benchmark", run_benchmark)
    with pytest.raises(Planned) as planned:
        run.main(["--off-grid"])
    kwargs = planned.value.args[0]
    assert kwargs["configs"] == grid.OFF_GRID_CONFIGS
    assert kwargs["kinds"] == ("layer",) and kwargs["impls"] == ("auto", "torch")
    assert kwargs["dtypes"] == ("float32", "float64") and kwargs["masks"] == grid.MASKS
    assert not kwargs["memory"] and not kwargs["training"] and kwargs["import_repeats"] == 0
    with pytest.raises(Planned) as planned:  # an explicit option still wins
        run.main(["--off-grid", "--configs", "2,8,16,2", "--dtypes", "float64"])
    assert [tuple(c) for c in planned.value.args[0]["configs"]] == [(2, 8, 16, 2)]
    assert planned.value.args[0]["dtypes"] == ["float64"]
    with pytest.raises(SystemExit) as exited:  # two presets: argparse's error
        run.main(["--off-grid", "--quick"])
    assert exited.value.code == 2


def test_max_length_keeps_the_small_and_medium_shapes(monkeypatch, capsys):
    # oracle: the grid's shapes listed by hand, cut at L <= 512 and L <= 128
    class Planned(Exception):
        pass

    def run_benchmark(**kwargs):
        raise Planned(kwargs)

    monkeypatch.setattr(run, "run_benchmark", run_benchmark)
    users = [(1, 6, 3, 1), (8, 16, 32, 4), (64, 8, 16, 2), (16, 32, 64, 4), (64, 33, 64, 1),
             (32, 64, 128, 8)]
    with pytest.raises(Planned) as planned:
        run.main(["--max-length", "512"])
    kwargs = planned.value.args[0]
    assert [tuple(c) for c in kwargs["configs"]] == users + [(8, 128, 256, 8), (4, 512, 512, 8)]
    assert kwargs["dtypes"] == ("float32", "float64") and kwargs["masks"] == grid.MASKS
    assert kwargs["memory"] and kwargs["training"] and kwargs["import_repeats"] == 7
    assert not kwargs["tiled_memory"]  # its L = 16384 is beyond the limit
    with pytest.raises(Planned) as planned:
        run.main(["--max-length", "128"])
    assert [tuple(c) for c in planned.value.args[0]["configs"]] == users + [(8, 128, 256, 8)]
    with pytest.raises(Planned) as planned:  # with a preset: its shapes, cut
        run.main(["--off-grid", "--max-length", "128"])
    assert [tuple(c) for c in planned.value.args[0]["configs"]] == [
        (1, 16, 768, 12), (4, 100, 64, 4), (1, 128, 768, 12), (8, 128, 768, 12)]
    with pytest.raises(Planned) as planned:  # the full grid still measures the tiled core
        run.main([])
    assert planned.value.args[0]["tiled_memory"]
    with pytest.raises(SystemExit) as exited:
        run.main(["--max-length", "5"])
    assert exited.value.code == 2
    assert "--max-length 5 leaves no configuration" in capsys.readouterr().err


def test_missing_pytorch_is_said_once(tmp_path):
    # oracle: the command's own output, in a fresh process whose `import torch`
    # fails (a torch.py raising ImportError first on PYTHONPATH, inherited by
    # the worker processes): two shapes x two masks, the training steps, yet
    # one note on stderr and one line in the report
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "torch.py").write_text("raise ImportError('PyTorch hidden by the test')\n")
    env = dict(os.environ, PYTHONPATH=str(hidden))
    argv = ["--configs", "1,16,16,2", "1,130,16,2", "--dtypes", "float64", "--kinds", "layer",
            "--impls", "auto", "torch", "--repeats", "1", "--no-memory", "--import-repeats", "0",
            "--pause", "0", "--gemm-size", "128", "--round-time", "0.001"]
    done = subprocess.run([sys.executable, os.path.join(BENCHMARKS_DIR, "run.py"), *argv],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    hint = attention.TORCH_MISSING
    assert done.stderr.count(hint) == 1, done.stderr
    assert done.stderr.index(hint) < done.stderr.index("[1/"), done.stderr  # up front
    assert done.stdout.count(hint) == 1 and "MISSING" not in done.stdout, done.stdout
    assert "torch not installed" in done.stdout
    assert "No attention comparison with PyTorch was measured: PyTorch is not installed." in done.stdout
    # one row per shape and mask: qkvnp's default path; none for PyTorch
    assert done.stdout.count("(1,16,16,2)") == 2 and done.stdout.count("(1,130,16,2)") == 2
    assert "kv-recall  float64" in done.stdout and "teacher    float64" in done.stdout


@pytest.mark.parametrize("kind", ["layer", "core"])
def test_causal_problem_changes_the_output(kind):
    # oracle: a behavioural property; under the causal mask, changing the last
    # position's input does not change the first position's output
    problem = attention.make_problem(kind, TINY, "float64", causal=True)
    out = attention.make_runner("reference", problem).result()["out"]
    plain = attention.make_runner("reference", attention.make_problem(kind, TINY, "float64")).result()["out"]
    assert out.shape == plain.shape
    assert not np.allclose(out, plain)
    name = "x" if kind == "layer" else "key"
    problem.arrays[name][..., -1, :] += 1.0
    changed = attention.make_runner("reference", problem).result()["out"]
    np.testing.assert_array_equal(changed[..., 0, :], out[..., 0, :])


def test_worker_process_checks_and_times_one_library(tmp_path):
    # oracle: this process's runner on the same inputs, within the paths'
    # tolerance (not bitwise: the two processes may split the work over
    # threads differently); the round protocol returns one time per round
    from benchmarks.harness import workers

    with workers.WorkerPool(machine.CHILD_PATH) as pool:
        worker = pool.get("fast")
        spec = {"kind": "layer", "config": list(TINY), "dtype": "float64", "causal": True,
                "impl": "fast"}
        assert worker.request("setup", workload="attention", spec=spec)["library"] == "qkvnp"
        reply = worker.request("result", path=str(tmp_path / "r.npz"))
        assert reply["dispatch"]["path"] == "fast"
        with np.load(tmp_path / "r.npz") as stored:
            results = dict(stored)
        expected = attention.make_runner("fast", attention.make_problem("layer", TINY, "float64",
                                                                 causal=True)).result()
        assert sorted(results) == sorted(expected)
        check = crosscheck.cross_check(results, expected, "float64")
        assert check.ok, check
        seconds, calls = workers.time_alternating({"fast": worker}, "fwd_bwd", repeats=3,
                                                  warmup=1, pause=0, round_seconds=0.001)
        assert len(seconds["fast"]) == 3 and calls["fast"] >= 1
        with pytest.raises(workers.WorkerError, match="unknown op"):
            worker.request("no-such-op")
        bad = dict(spec, impl="no-such-impl")
        with pytest.raises(workers.WorkerError):
            worker.request("setup", workload="attention", spec=bad)
    assert worker.process.poll() is not None  # the pool closed it


def test_process_case_refuses_a_wrong_result(monkeypatch):
    # oracle: a worker whose results are off by 0.1% must be refused and not
    # timed; the other implementation is still timed
    from benchmarks.harness import workers

    class FakeWorker:
        def __init__(self, impl, scale):
            self.impl, self.scale = impl, scale

        def request(self, op, **fields):
            if op == "setup":
                return {"library": "qkvnp"}
            if op == "result":
                problem = attention.make_problem("layer", TINY, "float64")
                results = attention.make_runner("reference", problem).result()
                results["dx"] = results["dx"] * self.scale
                np.savez(fields["path"], **results)
                return {"saved": fields["path"]}
            if op == "calibrate":
                return {"calls": 2}
            return {"seconds": 0.002}

    class FakePool:
        def get(self, impl):
            return FakeWorker(impl, 1.001 if impl == "fast" else 1.0)

    monkeypatch.setattr(workers.time, "sleep", lambda seconds: None)
    records = bench.run_case_in_processes("layer", TINY, np.dtype("float64"), ["fast", "auto"],
                                           repeats=2, warmup=0, pause=0.1, pool=FakePool())
    by_impl = {r["impl"]: r for r in records}
    assert by_impl["fast"]["status"] == "refused" and by_impl["fast"]["fwd_bwd"] is None
    assert by_impl["auto"]["status"] == "ok"
    assert by_impl["auto"]["fwd_bwd"]["times_ms"] == [1.0, 1.0]  # 0.002 s / 2 calls
    assert by_impl["auto"]["protocol"] == "processes"


# ---------------------------------------------------------------- training


@pytest.mark.parametrize("task", ["kv-recall", "teacher"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_training_steps_agree_with_pytorch(torch, task, dtype):
    # oracle: PyTorch autograd and torch.optim.Adam on the same model, weights
    # and batches (the benchmark's own check, run here in one process)
    from benchmarks.workloads import training

    data = training.make_training_data(task, dtype, batches=3)
    ours = training.make_training_runner("qkvnp", task, dtype, data).result()["loss"]
    theirs = training.make_training_runner("torch", task, dtype, data).result()["loss"]
    assert ours.shape == theirs.shape == (training.CHECK_STEPS,)
    error, ok = training.check_losses(ours, theirs, dtype)
    assert ok, (ours, theirs, error)
    assert theirs[-1] < theirs[0] or task == "kv-recall"  # the teacher's loss falls at once


def test_training_check_refuses_a_different_trajectory():
    from benchmarks.workloads import training

    losses = np.array([2.0, 1.5, 1.2])
    assert training.check_losses(losses, losses * (1 + 1e-10), "float64")[1]
    assert not training.check_losses(losses, losses * (1 + 1e-7), "float64")[1]
    assert not training.check_losses(losses[:2], losses, "float32")[1]
    assert not training.check_losses(losses * np.nan, losses, "float32")[1]


# ---------------------------------------------------------------- what users read


def ratio_record(config, dtype, mask, impl, ratio, flops=1000):
    return {"kind": "layer", "config": list(config), "dtype": dtype, "mask": mask, "impl": impl,
            "status": "ok", "memory": None,
            "fwd_bwd": {"ratio_torch": ratio, "flops": flops, "median_ms": 1.0}}


def test_summary_states_each_result_plainly():
    # oracle: hand-made ratios; small shapes at 0.5x and 0.4x are 2.0x and 2.5x
    # faster (geometric mean 0.447 -> 2.2x faster), L = 2048 at 1.1x is slower
    from benchmarks.reports import summary

    report = {"records": [ratio_record((1, 6, 3, 1), "float32", "none", "auto", 0.5),
                          ratio_record((1, 6, 3, 1), "float64", "causal", "auto", 0.4),
                          ratio_record((1, 6, 3, 1), "float32", "none", "torch", 1.0),
                          ratio_record((1, 2048, 512, 8), "float32", "none", "auto", 1.1)],
              "training": [{"task": "teacher", "dtype": "float64", "status": "ok", "reason": None,
                            "qkvnp": {"steps_per_s": 600.0}, "torch": {"steps_per_s": 300.0},
                            "speedup": 2.0}]}
    text = "\n".join(summary.summarize(report))
    assert "small shapes (B*L*E <= 16,384: (1, 6, 3, 1)): qkvnp is 2.2x faster than PyTorch" in text
    assert "from 2.5x faster at (1, 6, 3, 1) float64 causal to 2.0x faster at (1, 6, 3, 1) float32" in text
    assert "L = 2048 ((1, 2048, 512, 8)): qkvnp is 1.1x slower than PyTorch." in text
    assert "teacher float64: qkvnp 600 steps/s, PyTorch 300 steps/s: qkvnp is 2.0x faster" in text
    assert "issue" not in text.lower() and "target" not in text.lower()
    table = summary.ratio_table(report)
    assert table[1].split() == ["(B,", "L,", "E,", "H)", "MFLOP", "float32", "float64", "causal"]
    assert table[3].split()[-2:] == ["0.50", "0.40"] and table[4].split()[-2:] == ["1.10", "-"]


def test_printed_report_has_no_target_list_unless_asked():
    report = {"environment": machine.environment_info(), "gemm_peak_gflops": {"float32": 100.0},
              "settings": {"impls": ["auto", "torch"], "repeats": 7, "warmup": 1,
                           "pause_s": 0.3, "gemm_size": 2048},
              "import_time": {"ratio": 1.1, "numpy_ms": 50.0, "qkvnp_ms": 55.0,
                              "numpy_min_ms": 50.0, "qkvnp_min_ms": 55.0, "repeats": 7,
                              "extra_modules": []},
              "tiled_memory": None,
              "records": [dict(ratio_record((4, 512, 512, 8), "float32", "none", impl, ratio),
                               fwd=None, check=None, protocol="same process",
                               fwd_bwd={"ratio_torch": ratio, "flops": 10**9, "median_ms": 9.0,
                                        "q1_ms": 8.0, "q3_ms": 10.0, "gflops": 1.0,
                                        "percent_peak": 1.0})
                          for impl, ratio in (("auto", 0.9), ("torch", 1.0))]}
    plain = format_report(report)
    assert "issue" not in plain.lower() and "target" not in plain.lower()
    assert "qkvnp is 1.1x faster than PyTorch" in plain
    report["show_targets"] = True
    assert "developers' targets (--targets" in format_report(report)


def test_ratio_plot_has_one_series_per_dtype_and_mask(monkeypatch, tmp_path):
    # a recording stand-in for matplotlib (absent here): x = work, y = ratio
    import types
    from unittest import mock

    from benchmarks.reports import summary

    axis, figure = mock.MagicMock(), mock.MagicMock()
    figure.savefig.side_effect = lambda stream, format: stream.write(b"PNG")
    pyplot = types.SimpleNamespace(subplots=mock.MagicMock(return_value=(figure, axis)),
                                   close=mock.MagicMock())
    monkeypatch.setitem(sys.modules, "matplotlib",
                        types.SimpleNamespace(use=lambda backend: None, pyplot=pyplot))
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    report = {"records": [ratio_record((1, 6, 3, 1), "float32", "none", "auto", 0.5, 10),
                          ratio_record((8, 16, 32, 4), "float32", "none", "auto", 0.8, 1000),
                          ratio_record((1, 6, 3, 1), "float64", "causal", "auto", 0.4, 10),
                          ratio_record((1, 6, 3, 1), "float64", "causal", "fast", 9.9, 10)]}
    assert summary.plot_ratios(report, tmp_path / "ratio.png") is True
    drawn = {call.kwargs["label"]: call.args[:2] for call in axis.plot.call_args_list}
    assert drawn == {"float32, no mask": ([10, 1000], [0.5, 0.8]),
                     "float64, causal": ([10], [0.4])}
    assert axis.set.call_args.kwargs["xscale"] == "log"
    assert (tmp_path / "ratio.png").read_bytes() == b"PNG"


def test_layer_ceiling_uses_the_tiled_cores_blocks_and_runs():
    """Oracle: the tiled core's own choice of blocks (its cache records them),
    for the layer's leading dims at long lengths, with and without threads; and
    the ceiling script's products run for a dense and a tiled causal layer."""
    from benchmarks import layer_ceiling
    from qkvnp.kernels import num_threads, tiled

    rng = np.random.default_rng(0)
    for (B, H, T, D) in [(1, 4, 600, 8), (1, 8, 300, 4), (2, 2, 100, 4)]:
        q = rng.standard_normal((B, H, T, D))
        for threads in (1, 2):
            with num_threads(threads):
                _, cache = tiled.attention_forward(q, q, q)
                assert layer_ceiling.tiled_blocks(B * H, T, T, threads) == (cache.block_q,
                                                                             cache.block_k)
    for config in [(2, 8, 8, 2), (1, 64, 8, 2)]:
        path, blocks, floor, ours, theirs = layer_ceiling.measure(config, np.float64, True, 1)
        assert path == "fast" and floor > 0 and ours > 0
    with num_threads(2):
        x = rng.standard_normal((4 * 16, 8))
        W_in, W_out = rng.standard_normal((8, 24)), rng.standard_normal((8, 8))
        heads = rng.standard_normal((4 * 16, 24))[:, :8].reshape(4, 16, 2, 4).swapaxes(1, 2)
        layer_ceiling.layer_products(x, W_in, W_out, heads, heads, heads, "tiled", True, (5, 3))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_kv_recall_floor_is_the_same_step(dtype):
    """Oracle: qkvnp's own training step (workloads/training.py) on the same initial
    weights and batches; the floor's losses over the check steps must agree
    within the benchmark's tolerances, or its time would be the floor of
    another computation. Its products, run on the same arrays, must give the
    attention scores of the floor's formula."""
    from benchmarks import kv_recall_ceiling

    error = kv_recall_ceiling.check_floor(dtype)
    assert error <= (1e-5 if dtype == np.float32 else 1e-12)
    rng = np.random.default_rng(0)
    B, P, E, V = 3, 4, 5, 6
    X = rng.standard_normal((B, P, E))
    q, Wq, Wk, Wv = (rng.standard_normal(shape) for shape in ((B, E), (E, E), (E, E), (E, E)))
    Wr, dlogits = rng.standard_normal((E, V)), rng.standard_normal((B, V))
    scores = kv_recall_ceiling.step_products(X, q, Wq, Wk, Wv, Wr, dlogits, num_keys=7)
    np.testing.assert_allclose(scores, np.einsum("bpe,be->bp", X @ Wk, q @ Wq), rtol=1e-12)


def test_report_states_what_the_second_core_adds():
    # oracle: hand-made peaks; 200 GFLOP/s on numpy's threads against 100 on one is 2.00x
    report = {"environment": machine.environment_info(),
              "settings": {"impls": [], "gemm_size": 2048, "repeats": 7, "warmup": 1, "pause_s": 0.3},
              "gemm_peak_gflops": {"float32": 200.0, "float64": 102.0},
              "gemm_one_thread_gflops": {"float32": 100.0, "float64": 100.0},
              "import_time": None, "records": []}
    line = [line for line in format_report(report).splitlines()
            if line.startswith("GEMM on one BLAS thread")]
    assert line == ["GEMM on one BLAS thread (same products): float32 100.0 GFLOP/s (numpy's "
                    "threads give 2.00x it), float64 100.0 GFLOP/s (numpy's threads give 1.02x it)"]
    del report["gemm_one_thread_gflops"]  # reports of earlier runs have no such field
    assert not any(line.startswith("GEMM on one") for line in
                   format_report(report).splitlines())


def test_one_thread_gemm_peak_is_measured_on_one_thread():
    # oracle: the count numpy's OpenBLAS reports from inside the measurement
    seen = []
    original = machine.measure_gemm_peak

    def spy(dtype, size=machine.GEMM_SIZE, repeats=5, blas=None):
        if blas is None:
            functions = openblas_thread_functions()
            seen.append(functions[0]() if functions else None)
        return original(dtype, size, repeats, blas)

    with mock.patch.object(machine, "measure_gemm_peak", spy):
        gflops = machine.measure_gemm_peak("float64", 64, 1, blas=1)
    if openblas_thread_functions():
        assert seen == [1] and gflops > 0
    else:
        assert gflops is None and seen == []
