"""The README's "Coming from PyTorch or the book" examples run and say what they print.

Oracle: the examples' own assertions, and the book's printed context vector
for the first token (``[0.3190, 0.4858]``, which the README quotes).
"""
import contextlib
import io
import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parent.parent / "README.md"


def section_examples():
    """The ```python blocks of the README section "Coming from PyTorch or the book"."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## Coming from PyTorch or the book", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_section_has_its_two_examples():
    blocks = section_examples()
    assert len(blocks) == 2
    assert "import torch" not in blocks[0] and "import torch" in blocks[1]


def test_book_example_prints_the_books_numbers():
    output = io.StringIO()
    namespace = {}
    with contextlib.redirect_stdout(output):
        exec(compile(section_examples()[0], "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["context"].shape == (2, 6, 2)
    np.testing.assert_allclose(namespace["context"][0, 0], [0.3190, 0.4858], atol=5e-5)
    assert output.getvalue().strip() == str(np.array([0.319, 0.4858]))


def test_torch_example_runs(torch):
    namespace = {}
    exec(compile(section_examples()[1], "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["y"].shape == (2, 5, 16)
