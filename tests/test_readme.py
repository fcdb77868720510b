"""The README's code and the documentation pages' examples run.

Oracles: the gradient check's own verdict in the README's taste; the
walkthrough's printed weights and context vector of "journey" on the
attention page; the cached decoding equal to the causal forward on the
getting-started page; the book's printed context vector for the first token
(``[0.3190, 0.4858]``) and PyTorch's own layer, to 1e-12, on the PyTorch
page.
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


def test_getting_started_taste_runs():
    blocks = python_blocks(ROOT / "docs" / "getting_started.md")
    assert len(blocks) == 1
    namespace, output = run(blocks[0], "docs/getting_started.md")
    # the decoded steps equal the causal forward, as the page says
    assert output.splitlines()[-1] == "True"
    assert namespace["y"].shape == (2, 5, 16)


def test_attention_page_gives_the_walkthroughs_numbers():
    blocks = python_blocks(ROOT / "docs" / "attention.md")
    assert len(blocks) == 1
    namespace, _ = run(blocks[0], "docs/attention.md")
    # the page's step 4 and step 5 numbers, for token 2 ("journey")
    np.testing.assert_allclose(namespace["weights"][1],
                               [0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820], atol=5e-5)
    np.testing.assert_allclose(namespace["context"][1], [0.3061, 0.8210], atol=5e-5)

