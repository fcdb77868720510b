"""The README's code and the "Coming from PyTorch or the book" page's examples run.

Oracles: the README's taste of the API asserts its own claims (the cached
decoding equals one causal forward; the gradient check passes); the book's
printed context vector for the first token (``[0.3190, 0.4858]``, which the
page quotes); PyTorch's own layer, to 1e-12, in the page's second example.
"""
import contextlib
import io
import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PYTORCH_PAGE = ROOT / "docs" / "pytorch.md"


def python_blocks(path):
    """The ```python blocks of a Markdown file."""
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def run(code, filename):
    namespace = {}
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(code, filename, "exec"), namespace)  # noqa: S102
    return namespace, output.getvalue()


def test_readme_is_a_front_door():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    text = "\n".join(lines)
    # the two set-up commands, as they are
    assert "pip install -e ." in text
    assert "pip install -e '.[test]' && python -m pytest" in text
    assert "the seeds" not in text.lower()


def test_readme_taste_runs():
    blocks = python_blocks(README)
    assert len(blocks) == 1
    namespace, output = run(blocks[0], "README.md")
    assert namespace["y"].shape == (2, 5, 16)
    assert namespace["dx"].shape == namespace["x"].shape
    assert "): OK" in output  # the gradient check's verdict line


def test_the_page_has_its_two_examples():
    blocks = python_blocks(PYTORCH_PAGE)
    assert len(blocks) == 2
    assert "import torch" not in blocks[0] and "import torch" in blocks[1]


def test_book_example_prints_the_books_numbers():
    namespace, output = run(python_blocks(PYTORCH_PAGE)[0], "docs/pytorch.md")
    assert namespace["context"].shape == (2, 6, 2)
    np.testing.assert_allclose(namespace["context"][0, 0], [0.3190, 0.4858], atol=5e-5)
    assert output.strip() == str(np.array([0.319, 0.4858]))


def test_torch_example_runs(torch):
    namespace, _ = run(python_blocks(PYTORCH_PAGE)[1], "docs/pytorch.md")
    assert namespace["y"].shape == (2, 5, 16)
