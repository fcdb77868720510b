"""Every Python block of the documentation runs, in order, page by page.

Oracle: the blocks themselves. Each page (``docs/*.md`` and ``README.md``)
runs in a fresh Python process, its blocks top to bottom in one namespace,
as a reader pasting them one after another would run them; any exception,
or a page running past its timeout, fails the page's test with the page,
the block's number, the block's first line and the failing line.

Which blocks run: fenced blocks whose language is ``python`` or ``py``,
``pycon`` (the ``>>>`` and ``...`` lines), and MyST's ``{code-block}`` with
one of those languages. Shell blocks (``bash``, ``console``, ``text``) are
not run. A block may be left out only with a marker on the line before it
that gives the reason, and only for a download, a file the reader brings or
a run longer than a minute::

    <!-- not run: needs the book's chapter 4 code, which the reader brings -->

A marker without a reason, or a marker before a block the runner would not
run anyway, fails the test of its page.

A page's blocks after the first one that imports PyTorch run only where
PyTorch is installed (everywhere under ``QKVNP_REQUIRE_TORCH=1``).
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
#: seconds a page may take; the whole docs run stays near a minute
TIMEOUT = 60

RUN_LANGUAGES = {"python", "py", "pycon"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)\s*(?P<info>.*?)\s*$")
MARKER = re.compile(r"^\s*<!--\s*not run\b\s*:?\s*(?P<reason>.*?)\s*-->\s*$")


class Block:
    """One fenced block: where it starts, its language, its code, its marker."""

    def __init__(self, path, line, language, code, marker):
        self.path, self.line, self.language = path, line, language
        self.code, self.marker = code, marker  # marker: None, or the reason ("" if none given)

    @property
    def runs(self):
        return self.language in RUN_LANGUAGES


def _language(info):
    """``python`` from ``python``, ``{code-block} python``, ``{code-cell} python``."""
    words = info.split()
    if not words:
        return ""
    if words[0].startswith("{") and words[0].endswith("}"):
        return words[1].lower() if len(words) > 1 else ""
    return words[0].lower()


def blocks(path, text=None):
    """Every fenced block of a Markdown page, in order."""
    lines = (path.read_text(encoding="utf-8") if text is None else text).splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening or not opening["fence"]:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        body, j = [], i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence)
                                      and lines[j].strip().strip(fence[0]) == ""):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        previous = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = MARKER.match(previous)
        language = _language(opening["info"])
        first = i + 2  # the 1-based line of the body's first line
        if opening["info"].startswith("{"):
            while body and body[0].startswith(":"):  # a directive's options
                body.pop(0)
                first += 1
        code = "\n".join(body) + "\n"
        if language == "pycon":
            code = "\n".join(line[4:] if line[:4] in (">>> ", "... ") else ""
                             for line in body) + "\n"
        found.append(Block(path, first, language, code, marker["reason"] if marker else None))
        i = j + 1
    return found


#: The child process: runs the blocks in one namespace, and on a failure
#: prints the page, the block, the block's first line and the failing line.
DRIVER = textwrap.dedent('''
    import json, sys, traceback
    namespace = {"__name__": "__main__"}
    for block in json.load(sys.stdin):
        # padded so that tracebacks give the page's own line numbers
        code = "\\n" * (block["line"] - 1) + block["code"]
        try:
            exec(compile(code, block["path"], "exec"), namespace)
        except BaseException:
            frames = [f for f in traceback.extract_tb(sys.exc_info()[2])
                      if f.filename == block["path"]]
            where = frames[-1] if frames else None
            first = block["code"].strip().splitlines()[0] if block["code"].strip() else ""
            print(f"{block['path']}: block {block['number']} (line {block['line']}: {first!r}) "
                  f"failed at line {where.lineno if where else '?'}: "
                  f"{where.line if where else ''}", file=sys.stderr)
            traceback.print_exc()
            sys.exit(1)
''')


def run_page(path, text=None, timeout=TIMEOUT, torch_available=None):
    """Run a page's blocks; ``(ran, problems)``, problems a list of messages."""
    if torch_available is None:
        torch_available = (importlib.util.find_spec("torch") is not None
                           or os.environ.get("QKVNP_REQUIRE_TORCH") == "1")
    name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    problems, to_run = [], []
    for number, block in enumerate(blocks(path, text), start=1):
        if block.marker is not None:
            if not block.marker:
                problems.append(f"{name}: block {number} (line {block.line}): a not-run "
                                f"marker must give its reason: <!-- not run: why -->")
            elif not block.runs:
                problems.append(f"{name}: block {number} (line {block.line}): a not-run marker "
                                f"on a {block.language or 'plain'} block, which never runs")
            continue
        if not block.runs:
            continue
        if not torch_available and re.search(r"^\s*(import|from) torch\b", block.code, re.M):
            break  # the rest of the page needs PyTorch
        to_run.append({"path": name, "number": number, "line": block.line,
                       "code": block.code})
    if problems or not to_run:
        return to_run, problems
    env = dict(os.environ, MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        done = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(to_run),
                              capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=os.environ.get("QKVNP_DOCS_RUN_DIR", None))
    except subprocess.TimeoutExpired:
        problems.append(f"{name}: its blocks ran past {timeout} s")
    else:
        if done.returncode != 0:
            problems.append(done.stderr.strip()[-4000:])
    return to_run, problems


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_every_block_of_the_page_runs_in_order(path, tmp_path, monkeypatch):
    monkeypatch.setenv("QKVNP_DOCS_RUN_DIR", str(tmp_path))  # files the blocks write
    ran, problems = run_page(path)
    assert not problems, "\n".join(problems)


# The runner's own tests: it must be able to fail.

def _page(tmp_path, text):
    path = tmp_path / "page.md"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_failing_block_fails_naming_page_block_and_line(tmp_path):
    text = ("# A page\n\n```python\nx = 1\n```\n\n```bash\nexit 1\n```\n\n"
            "```python\ny = x + 1\nz = y / 0\n```\n")
    ran, problems = run_page(_page(tmp_path, text))
    assert len(ran) == 2  # the bash block does not run
    assert len(problems) == 1
    assert "block 3 (line 12: 'y = x + 1') failed at line 13: z = y / 0" in problems[0]
    assert "ZeroDivisionError" in problems[0]


def test_blocks_share_one_namespace_in_order(tmp_path):
    text = "```python\nx = 2\n```\n\n```{code-block} python\n:caption: c\nassert x == 2\n```\n"
    ran, problems = run_page(_page(tmp_path, text))
    assert len(ran) == 2 and not problems, problems


def test_pycon_blocks_run_their_prompts(tmp_path):
    text = "```pycon\n>>> x = 3\n>>> assert x == 4\nTraceback\n```\n"
    _, problems = run_page(_page(tmp_path, text))
    assert len(problems) == 1 and "AssertionError" in problems[0]


def test_a_marker_with_a_reason_leaves_a_block_out(tmp_path):
    text = "<!-- not run: downloads 500 MB -->\n```python\nraise SystemExit(1)\n```\n"
    ran, problems = run_page(_page(tmp_path, text))
    assert ran == [] and problems == []


@pytest.mark.parametrize("marker", ["<!-- not run -->", "<!-- not run: -->"])
def test_a_marker_without_a_reason_is_refused(tmp_path, marker):
    text = f"{marker}\n```python\nx = 1\n```\n"
    _, problems = run_page(_page(tmp_path, text))
    assert len(problems) == 1 and "must give its reason" in problems[0]


def test_a_timeout_fails_the_page(tmp_path):
    text = "```python\nimport time\ntime.sleep(30)\n```\n"
    _, problems = run_page(_page(tmp_path, text), timeout=1)
    assert problems == [f"{tmp_path / 'page.md'}: its blocks ran past 1 s"]


def test_every_guide_page_has_blocks_that_run():
    # a parsing slip would pass every page by running nothing
    for name in ["getting_started", "attention", "masks", "variants", "gpt_guide",
                 "pytorch", "gradcheck", "performance", "derivations"]:
        page = ROOT / "docs" / f"{name}.md"
        assert any(block.runs and block.marker is None for block in blocks(page)), name
