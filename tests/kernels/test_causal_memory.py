"""Memory of causal attention: no ``(T, S)`` mask on the tiled path, bounded caches.

Oracles: the peak and the retained bytes that ``tracemalloc`` (which numpy
reports its arrays to) measures, against the same layer without a mask (the
tiled path's memory is linear in length) and against the documented budget
:data:`qkvnp.ops.masks.CAUSAL_CACHE_BYTES`; the reference path for the values.
"""
import gc
import tracemalloc

import numpy as np
import pytest

import qkvnp
from qkvnp import kernels
from qkvnp.ops.masks import (CAUSAL_CACHE_BYTES, additive_mask, causal_factors, causal_mask,
                         causal_mask_offset)


def _peak_bytes(call):
    """Peak bytes allocated while ``call()`` runs (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("is_causal, T, S", [
    (True, 2048, 2048),  # self-attention, top-left
    ("bottom_right", 1536, 2048),  # cross-attention, the last query sees every key
])
def test_causal_tiled_layer_peaks_near_the_unmasked_layer(is_causal, T, S):
    rng = np.random.default_rng(0)
    layer = qkvnp.MultiHeadAttention(16, 1, rng=0, impl="tiled")
    query = rng.standard_normal((1, T, 16))
    key = rng.standard_normal((1, S, 16))
    dy = rng.standard_normal((1, T, 16))

    def forward_backward(mask):
        layer.forward(query, key, is_causal=mask)
        layer.backward(dy)

    with kernels.num_threads(2):
        forward_backward(False)  # warm-up: workers, heap thresholds, BLAS probe
        unmasked = _peak_bytes(lambda: forward_backward(False))
        causal = _peak_bytes(lambda: forward_backward(is_causal))
    dense_mask = T * S  # bytes of one boolean (T, S) mask
    assert causal - unmasked < dense_mask / 2, (
        f"causal peak {causal / 2**20:.2f} MiB against {unmasked / 2**20:.2f} MiB unmasked; "
        f"a (T, S) bool mask is {dense_mask / 2**20:.2f} MiB")
    # and the values are the reference path's
    out = layer.forward(query, key, is_causal=is_causal)
    reference = qkvnp.MultiHeadAttention(16, 1, rng=0, impl="reference")
    np.testing.assert_allclose(out, reference.forward(query, key, is_causal=is_causal),
                               rtol=1e-10, atol=1e-10)


def test_a_kv_cache_prefill_on_the_tiled_path_peaks_near_the_unmasked_layer():
    # the prefill step is causal (bottom-right) over T = S tokens
    T = 2048
    x = np.random.default_rng(2).standard_normal((1, T, 4))
    layer = qkvnp.MultiHeadAttention(4, 1, rng=0, impl="tiled")
    with kernels.num_threads(2):
        layer.forward(x)  # warm-up
        unmasked = _peak_bytes(lambda: layer.forward(x))
        cache = qkvnp.KVCache()
        prefill = _peak_bytes(lambda: layer.forward(x, kv_cache=cache))
    assert layer.last_dispatch.path == "tiled"
    assert prefill - unmasked < T * T / 2, (
        f"prefill peak {prefill / 2**20:.2f} MiB against {unmasked / 2**20:.2f} MiB unmasked")
    np.testing.assert_allclose(
        layer.forward(x, kv_cache=qkvnp.KVCache()),
        qkvnp.MultiHeadAttention(4, 1, rng=0, impl="reference").forward(x, is_causal=True),
        rtol=1e-10, atol=1e-10)


def test_causal_masks_kept_between_calls_stay_within_the_byte_budget():
    # 16 causal layers of 16 lengths on the dense path, each dropped after its
    # call: what the process still holds afterwards is the masks' cache
    rng = np.random.default_rng(1)
    gc.collect()
    tracemalloc.start()
    try:
        with kernels.block_sizes(recycle_bytes=0):  # no score buffers kept either
            before = tracemalloc.get_traced_memory()[0]
            for T in range(600, 616):  # each length's float64 masks: about 6 MiB
                layer = qkvnp.MultiHeadAttention(8, 1, rng=0, impl="fast")
                x = rng.standard_normal((1, T, 8))
                layer.forward(x, is_causal=True)
                layer.backward(rng.standard_normal((1, T, 8)))
                del layer, x
            gc.collect()
            kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept <= CAUSAL_CACHE_BYTES + (1 << 20), f"{kept / 2**20:.1f} MiB kept"


def test_a_causal_mask_too_large_to_keep_is_still_recognised_on_the_dense_path():
    T = 1100  # float64: 1.2 + 9.2 + 9.2 MiB, more than the budget
    assert T * T * 17 > CAUSAL_CACHE_BYTES
    for bottom_right, S in ((False, T), (True, T + 3)):
        allowed = causal_mask(T, S, bottom_right=bottom_right)
        mask = additive_mask(None, allowed, np.float64)
        assert causal_mask_offset(mask, np.float64) == (S - T if bottom_right else 0)
        factors = causal_factors(mask, np.float64)
        assert factors is not None  # 0 / 1 factors of the mask: the closed form is the mask
        np.testing.assert_array_equal(factors, allowed)
        np.testing.assert_array_equal(mask, np.where(allowed, 0.0, -np.inf))


def test_small_causal_masks_are_shared_between_calls():
    assert causal_mask(5, 7) is causal_mask(5, 7)
    assert additive_mask(None, causal_mask(5, 7), np.float32) is \
        additive_mask(None, causal_mask(5, 7), np.float32)
