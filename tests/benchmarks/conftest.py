"""What every benchmark test shares."""
import sys

import pytest


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """The benchmarks set PyTorch's thread count; give the other tests theirs back."""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None and threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
