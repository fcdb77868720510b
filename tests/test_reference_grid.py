"""Every number of a fixed grid of calls is what it was: a reorganisation changes no result.

Oracle: ``tests/golden/reference_grid.npz``, written by ``tests/reference_grid.py``
(the functional ops, every layer on every path in float64 and float32, the
transformer block, the GPT's forward, backward, decoding and sampled
tokens). On the machine that wrote the file (same processor, numpy and BLAS)
the comparison is bit for bit; on another one BLAS kernels may round
differently, and floats are compared to a few units in the last place of
their dtype (integers, such as token ids, always exactly).
"""
import json

import numpy as np
import pytest

from reference_grid import CASES, GRID_FILE, fingerprint

# NOTE: ulps of the dtype, relative to the array's largest magnitude: a
# different BLAS blocking reorders sums of a few dozen terms
ULPS = 64


@pytest.fixture(scope="module")
def recorded():
    with np.load(GRID_FILE, allow_pickle=False) as archive:
        arrays = {name: archive[name] for name in archive.files}
    made_on = json.loads(str(arrays.pop("__fingerprint__")))
    return arrays, made_on == fingerprint()


@pytest.mark.parametrize("name", list(CASES))
def test_the_grid_gives_what_it_gave(name, recorded):
    arrays, same_machine = recorded
    seed = list(CASES).index(name)
    got = {f"{name}/{key}": np.asarray(value)
           for key, value in CASES[name](np.random.default_rng(seed)).items()}
    want = {key: value for key, value in arrays.items() if key.startswith(name + "/")}
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].shape == want[key].shape and got[key].dtype == want[key].dtype, key
        if same_machine or got[key].dtype.kind not in "fc":
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        else:
            eps = np.finfo(want[key].dtype).eps
            scale = max(float(np.nanmax(np.abs(want[key]), initial=0.0)), 1.0)
            np.testing.assert_allclose(got[key], want[key], rtol=0, atol=ULPS * eps * scale,
                                       err_msg=key)
