"""Packaging metadata and the console script, checked without building.

Oracles: the files themselves. setup.cfg is read with configparser; what the
sdist ships is what setuptools' own MANIFEST.in interpreter selects, compared
with every file that is really under ``tests/``; what the wheel ships is what
``find_packages`` selects with setup.cfg's exclusions; the usage line is what
argparse prints. Building the sdist and wheel and running the suite from the
unpacked sdist is slow, so it is done by hand (see ``.ci/run`` for the two
environments the suite runs in).
"""
import ast
import configparser
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import qkvnp
from qkvnp.apps.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_cfg():
    config = configparser.ConfigParser()
    assert config.read(ROOT / "setup.cfg"), f"no setup.cfg in {ROOT}"
    return config


def cfg_list(value):
    """A multi-line setup.cfg value as a list of its non-empty lines."""
    return [line.strip() for line in value.splitlines() if line.strip()]


def requirement_floors(lines):
    """``["numpy>=1.22"]`` -> ``{"numpy": (1, 22)}``."""
    floors = {}
    for line in lines:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", line)
        assert match, f"install_requires: {line!r} is not a plain 'name>=version' floor"
        floors[match[1]] = tuple(int(part) for part in match[2].split("."))
    return floors


def literal_assignment(path, name):
    """The value of ``name = <literal>`` at the top level of ``path``."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == name for target in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} assigns no literal to {name}")


# ---------------------------------------------------------------- metadata


def test_version_is_single_sourced(setup_cfg):
    # setuptools>=61 reads the attr statically (ast), without importing qkvnp
    assert setup_cfg["metadata"]["version"] == "attr: qkvnp.__version__"
    source_version = literal_assignment(ROOT / "qkvnp" / "__init__.py", "__version__")
    assert re.fullmatch(r"\d+\.\d+\.\d+", source_version), source_version
    assert qkvnp.__version__ == source_version


def test_license_file_exists_and_is_shipped(setup_cfg):
    license_text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert license_text.splitlines()[0] == "MIT License"
    assert "Copyright (c) 2026 qkvnp developers" in license_text
    assert "THE SOFTWARE IS PROVIDED \"AS IS\"" in license_text
    metadata = setup_cfg["metadata"]
    # PEP 639: an SPDX expression; setuptools >= 77 refuses a license
    # classifier beside it, and warns about one without it
    assert metadata["license_expression"] == "MIT"
    assert "license" not in metadata
    assert cfg_list(metadata["license_files"]) == ["LICENSE"]
    assert not [c for c in cfg_list(metadata["classifiers"]) if c.startswith("License ::")]
    build = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert '"setuptools>=77"' in build, "license_expression needs setuptools 77"


def test_classifiers_name_the_audience_and_status(setup_cfg):
    classifiers = cfg_list(setup_cfg["metadata"]["classifiers"])
    assert "Intended Audience :: Education" in classifiers
    assert "Intended Audience :: Science/Research" in classifiers
    assert len([c for c in classifiers if c.startswith("Development Status ::")]) == 1


def test_classifiers_name_every_supported_python(setup_cfg):
    classifiers = cfg_list(setup_cfg["metadata"]["classifiers"])
    assert "Operating System :: OS Independent" in classifiers
    minors = sorted(int(c.rsplit(".", 1)[1]) for c in classifiers
                    if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    python_requires = setup_cfg["options"]["python_requires"]
    floor = re.fullmatch(r">=\s*3\.(\d+)", python_requires)
    assert floor, f"python_requires = {python_requires!r} is not a '>=3.N' floor"
    # the classifiers run from the floor, with no gap, through 3.13
    assert minors == list(range(int(floor[1]), 14)), minors


def test_install_requires_floors(setup_cfg):
    floors = requirement_floors(cfg_list(setup_cfg["options"]["install_requires"]))
    assert set(floors) == {"numpy", "scipy"}
    # NOTE: scipy 1.8's softmax is exp(x - logsumexp(x)): three scores tied at
    # the float max get weights summing to 3. 1.9 (scipy PR 16186) is the floor.
    assert floors["scipy"] >= (1, 9)
    # NOTE: numpy 1.22 and 1.23 sum float32 rows less accurately, and the
    # reference path's float32 dquery then drifts 2e-5 from the fast path's
    # (tests/kernels/test_fast.py, tolerance 1e-5); 1.24.0 is the first that passes.
    assert floors["numpy"] >= (1, 24)


def test_every_torch_install_hint_is_the_one_message(setup_cfg):
    """One hint, naming the extra; the extra alone sets the floor."""
    extras = setup_cfg["options.extras_require"]
    # a floor, not a pin, and only where PyTorch exists: an exact pin made
    # pip install 'qkvnp[torch]' unresolvable on Python 3.9
    assert cfg_list(extras["torch"]) == ['torch>=2.13; python_version >= "3.10"']
    hint = literal_assignment(ROOT / "tests" / "conftest.py", "TORCH_INSTALL_HINT")
    assert "'qkvnp[torch]'" in hint
    hints = {}
    for folder in ("qkvnp", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                text = node.value if isinstance(node, ast.Constant) else None
                if isinstance(text, str) and "pip install" in text and "torch" in text.lower():
                    hints.setdefault(text, []).append(str(path.relative_to(ROOT)))
    assert hint in hints, "conftest's TORCH_INSTALL_HINT is not where the hints are"
    assert list(hints) == [hint], f"hints that differ: {hints}"
    # CI installs PyTorch through the same extra, pinned to the version the
    # machines hold (another would be a download of gigabytes)
    ci_run = (ROOT / ".ci" / "run").read_text(encoding="utf-8") if (ROOT / ".ci").is_dir() else ""
    if ci_run:  # an unpacked sdist has no .ci/
        assert "'.[test,torch,docs]'" in ci_run
        assert "torch==2.13.0" in ci_run
        assert "QKVNP_REQUIRE_TORCH=1" in ci_run


# ---------------------------------------------------------------- sdist, wheel


def manifest_files():
    """The files MANIFEST.in adds, as setuptools' own interpreter reads it."""
    egg_info = pytest.importorskip("setuptools.command.egg_info")
    selected = egg_info.FileList()
    cwd = os.getcwd()
    os.chdir(ROOT)  # setuptools globs MANIFEST.in's patterns from the cwd
    try:
        for line in (ROOT / "MANIFEST.in").read_text(encoding="utf-8").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                selected.process_template_line(line)
    finally:
        os.chdir(cwd)
    return {Path(name).as_posix() for name in selected.files}


#: What a docs build writes (ignored by git, pruned by MANIFEST.in).
DOCS_GENERATED = ("docs/_build", "docs/auto_examples", "docs/api/generated")


def files_under(folder):
    """Every file under ``folder`` (relative to the root), less bytecode caches
    and what a docs build generates."""
    found = set()
    for directory, subdirs, names in os.walk(ROOT / folder):
        subdirs[:] = [d for d in subdirs if d != "__pycache__" and
                      (Path(directory) / d).relative_to(ROOT).as_posix() not in DOCS_GENERATED]
        for name in names:
            if not name.endswith((".pyc", ".pyo")):
                found.add((Path(directory) / name).relative_to(ROOT).as_posix())
    return found


def test_sdist_ships_the_whole_test_tree_and_what_it_needs():
    shipped = manifest_files()
    needed = files_under("tests") | files_under("docs") | files_under("examples")
    needed -= {"docs/sg_execution_times.rst"}  # written by a docs build
    needed |= {"LICENSE", "README.md", "CHANGELOG.md"}
    # tests/benchmarks runs the harness, which lives in benchmarks/
    needed |= {path for path in files_under("benchmarks") if path.endswith(".py")}
    for helper in ("tests/conftest.py", "tests/oracles.py", "tests/strategies.py"):
        assert helper in needed, f"{helper} is missing from the checkout itself"
    assert any(path.startswith("tests/golden/") and path.endswith(".npz") for path in needed)
    for subfolder in ("kernels", "training", "benchmarks"):
        assert any(path.startswith(f"tests/{subfolder}/test_") for path in needed), subfolder
    missing = sorted(needed - shipped)
    assert not missing, f"MANIFEST.in leaves out {missing}"
    built = sorted(path for path in shipped if path.startswith(DOCS_GENERATED))
    assert not built, f"MANIFEST.in ships what a docs build wrote: {built[:5]}"


def test_wheel_ships_the_library_only(setup_cfg):
    setuptools = pytest.importorskip("setuptools")
    exclude = cfg_list(setup_cfg["options.packages.find"]["exclude"])
    packages = setuptools.find_packages(str(ROOT), exclude=exclude)
    assert "qkvnp" in packages and "qkvnp.kernels" in packages
    assert all(name == "qkvnp" or name.startswith("qkvnp.") for name in packages), packages
    # the harness and the tests would be picked up as packages if they had an
    # __init__.py; the exclusions must hold them out anyway
    for name in ("tests", "tests.kernels", "benchmarks"):
        assert any(pattern == name or (pattern.endswith(".*") and name.startswith(pattern[:-1]))
                   for pattern in exclude), f"{name} is not excluded from the wheel"


# ---------------------------------------------------------------- console script


def test_console_script_entry_point(setup_cfg):
    scripts = cfg_list(setup_cfg["options.entry_points"]["console_scripts"])
    assert scripts == ["qkvnp = qkvnp.apps.cli:main"]


@pytest.mark.parametrize("argv0, prog", [
    ("/venv/bin/qkvnp", "qkvnp"),                       # the console script
    (r"C:\venv\Scripts\qkvnp.exe", "qkvnp"),            # its Windows launcher
    ("/src/qkvnp/__main__.py", "python -m qkvnp"),      # python -m qkvnp
    ("/venv/bin/pytest", "python -m qkvnp"),            # main(argv) from a test
])
def test_usage_line_names_the_program_that_was_run(monkeypatch, capsys, argv0, prog):
    if "\\" in argv0 and os.sep != "\\":
        argv0 = argv0.replace("\\", "/")  # basename splits on the host's separator
    monkeypatch.setattr(sys, "argv", [argv0, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {prog} [-h]")


def test_python_dash_m_usage_line():
    env = dict(os.environ, PYTHONPATH=str(Path(qkvnp.__file__).resolve().parents[1]))
    result = subprocess.run([sys.executable, "-m", "qkvnp", "--help"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m qkvnp [-h]"), result.stdout


def test_installed_console_script_usage_line():
    script = Path(sys.executable).parent / ("qkvnp.exe" if os.name == "nt" else "qkvnp")
    if not script.exists():
        pytest.skip(f"the console script is not installed beside {sys.executable}")
    result = subprocess.run([str(script), "bogus-command"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: qkvnp [-h]"), result.stderr


def test_wheel_ships_the_pep561_marker(setup_cfg):
    # oracle: PEP 561 -- a type checker reads a package's inline hints only
    # when the installed package holds a py.typed file
    assert (ROOT / "qkvnp" / "py.typed").is_file()
    assert "py.typed" in cfg_list(setup_cfg["options.package_data"]["qkvnp"])


def test_public_functions_carry_type_hints():
    # oracle: the signatures themselves; every public function and method of
    # the names the API reference documents states its parameter and return
    # types (the docstrings give the shapes)
    import inspect

    import qkvnp.functional
    import qkvnp.gradcheck
    import qkvnp.interop
    import qkvnp.training

    def public_callables():
        for module in (qkvnp, qkvnp.functional, qkvnp.gradcheck, qkvnp.interop, qkvnp.training):
            for name in module.__all__:
                obj = getattr(module, name)
                if inspect.isfunction(obj):
                    yield f"{module.__name__}.{name}", obj
                elif inspect.isclass(obj) and obj.__module__.startswith("qkvnp"):
                    for attr, member in vars(obj).items():
                        if inspect.isfunction(member) and (not attr.startswith("_") or attr == "__init__"):
                            yield f"{module.__name__}.{name}.{attr}", member

    missing = []
    for label, fun in public_callables():
        signature = inspect.signature(fun)
        unannotated = [p.name for p in signature.parameters.values()
                       if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
        if unannotated or signature.return_annotation is inspect.Signature.empty:
            missing.append(f"{label}({', '.join(unannotated)})")
    assert not missing, "public functions without type hints:\n" + "\n".join(sorted(set(missing)))
