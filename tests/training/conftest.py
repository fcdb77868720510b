"""Fixtures of the training tests: the text task's corpus as a file."""
import pytest

from text_task_args import CORPUS


@pytest.fixture
def corpus(tmp_path):
    """The path of a file holding ``text_task_args.CORPUS``."""
    path = tmp_path / "text.txt"
    path.write_bytes(CORPUS)
    return str(path)
