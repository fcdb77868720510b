"""The decoder's fused training blocks (qkvnp.kernels.decoder_train) against the layers.

Oracle: the blocks' own forward and backward (the reference path, the
layers' calls of the reference ops), in float64 to 1e-12 and float32 to
1e-5 relative, on Llama- and Qwen3-like configurations (GQA, QK-norm,
RoPE with YaRN's attention factor, a window, Gemma's unit offset, the
GeGLU MLP, learned positions without RoPE). Then the
seam (:func:`qkvnp.kernels.choose_train_path`) and the shared-state proofs:
the batch split over worker threads gives the same bits as one share at
any timing, a refused call changes nothing, and two threads training one
model at once each get their own cache and the serial sum of gradients.
"""
import threading

import numpy as np
import pytest

from qkvnp.kernels import _runtime, block_sizes, choose_train_path, num_threads
from qkvnp.kernels import decoder_train as kernel
from qkvnp.layers import decoder_block
from qkvnp.models.decoder import Decoder, DecoderConfig

TOL = {np.float64: 1e-12, np.float32: 1e-5}
V, B, T = 53, 4, 12


def _config(kind):
    common = dict(vocab_size=V, emb_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  hidden_dim=40, context_length=32)
    if kind == "qwen3":
        return DecoderConfig.qwen3(head_dim=8, **common)
    if kind == "llama-yarn":
        return DecoderConfig.llama3(rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                                 "original_max_position_embeddings": 16},
                                    **common)
    if kind == "geglu-learned":  # the tanh-GELU gate, learned positions (no RoPE)
        return DecoderConfig(mlp="geglu", positions="learned", **common)
    # a window and Gemma's (1 + weight) on pre-norm blocks, QK-norm, the GELU gate
    return DecoderConfig(norm_unit_offset=True, qk_norm=True, sliding_window=5, mlp="geglu",
                         layer_types=("sliding_attention", "full_attention"), **common)


def _close(actual, expected, dtype):
    assert actual.shape == expected.shape and actual.dtype == np.dtype(dtype)
    error = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30)
    assert error < TOL[dtype], f"relative error {error:.3g}"


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (B, T)), rng.standard_normal((B, T, V))


def _step(model, ids, dlogits):
    model.zero_grad()
    logits = model.forward(ids)
    model.backward(dlogits.astype(model.dtype))
    return logits, {name: grad.copy() for name, grad in model.grads.items()}


def _reference_step(model, ids, dlogits, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(decoder_block.DecoderBlock, "train_spec", lambda self: "forced")
        return _step(model, ids, dlogits)


@pytest.mark.parametrize("kind", ["qwen3", "llama-yarn", "window-offset", "geglu-learned"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_kernel_equals_the_blocks(kind, dtype, monkeypatch):
    """The stack's forward and backward (the kernel called directly) against the blocks' own."""
    model = Decoder(_config(kind), rng=1, dtype=dtype)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((B, T, 32)).astype(dtype)
    dout = rng.standard_normal((B, T, 32)).astype(dtype)
    positions = np.broadcast_to(np.arange(T), (B, T))[:, None, :]
    keep = np.tril(np.ones((T, T), bool))[None, None]
    keeps = [keep & (np.arange(T)[:, None] - np.arange(T)[None] < block.window)
             if block.window else keep for block in model.blocks]
    blocks = list(model.blocks)
    with monkeypatch.context() as patch:  # the seam would keep float64 on the layers
        patch.setattr("qkvnp.kernels.choose_train_path", lambda *a: type(
            "D", (), {"path": "fused"})())
        out, cache = decoder_block.train_blocks_forward(blocks, x, keeps, positions)
    dx = decoder_block.train_blocks_backward(blocks, dout, cache)
    fused_grads = {name: grad.copy() for name, grad in model.grads.items()}
    model.zero_grad()
    h = x
    for block, keep_l in zip(blocks, keeps):
        h = block.forward(h, keep_l, positions)
    d = dout
    for block in reversed(blocks):
        d = block.backward(d)
    _close(out, h, dtype)
    _close(dx, d, dtype)
    for name, grad in model.grads.items():
        _close(fused_grads[name], grad, dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tie", [False, True])  # a plain head runs in the shares, a tied one not
def test_float32_decoder_takes_the_fused_path_and_agrees(threads, tie, monkeypatch):
    import dataclasses

    config = dataclasses.replace(_config("qwen3"), tie_embeddings=tie)
    model = Decoder(config, rng=1, dtype=np.float32)
    ids, dlogits = _inputs()
    with num_threads(threads), block_sizes(batch_split_flops=0):
        logits, grads = _step(model, ids, dlogits)
        assert model._used_cache[2] is not None  # the fused blocks ran
        assert (model._used_cache[2].head is None) == tie
        expected, expected_grads = _reference_step(model, ids, dlogits, monkeypatch)
    _close(logits, expected, np.float32)
    for name in grads:
        _close(grads[name], expected_grads[name], np.float32)


def test_the_seam_names_its_reason():
    keep = np.tril(np.ones((3, 3), bool))[None, None]
    assert choose_train_path([{}], np.float32, [keep], ["fast"]).path == "fused"
    assert "float64" in choose_train_path([{}], np.float64, [keep], ["fast"]).reason
    assert "fast" in choose_train_path([{}], np.float32, [keep], ["reference"]).reason
    padded = keep & np.array([False, True, True])  # row 0 sees no key
    assert "padding" in choose_train_path([{}], np.float32, [padded], ["fast"]).reason
    gpt2 = Decoder(DecoderConfig.gpt2(vocab_size=V, emb_dim=16, num_layers=1, num_heads=2,
                                      hidden_dim=24, context_length=16), rng=0)
    assert isinstance(gpt2.blocks[0].train_spec(), str)  # LayerNorm, biases: the layers


def test_padding_and_float64_stay_on_the_layers():
    ids, _ = _inputs()
    model = Decoder(_config("qwen3"), rng=1, dtype=np.float32)
    mask = np.ones((B, T), int)
    mask[0, :3] = 0  # left padding: a query row with no key
    model.forward(ids, attention_mask=mask)
    assert model._cache[2] is None
    model64 = Decoder(_config("qwen3"), rng=1)
    model64.forward(ids)
    assert model64._cache[2] is None


@pytest.mark.parametrize("kind", ["qwen3", "window-offset"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_shared_causal_mask_gives_the_bits_of_the_batch_masks(kind, dtype, monkeypatch):
    """Oracle: the same step with every block's keep mask as ``(B, 1, T, T)`` arrays (what
    padding gives), bitwise. Without padding the forward passes the shared ``(T, T)``
    causal mask (and its windowed masks), which the cores recognise: the same math."""
    from qkvnp.models import decoder
    from qkvnp.ops.masks import causal_mask

    valid = np.ones((B, T), bool)
    assert decoder._keep_masks(valid, T, 0, 0, {None}, shared=True)[None] is causal_mask(T, T)
    assert decoder._keep_masks(valid[:, :-1], T, 0, 0, {None}, shared=True)[None].ndim == 4
    model = Decoder(_config(kind), rng=1, dtype=dtype)
    ids, dlogits = _inputs()
    shared = _step(model, ids, dlogits)
    real = decoder._keep_masks
    with monkeypatch.context() as patch:
        patch.setattr(decoder, "_keep_masks",
                      lambda *args, shared=False: real(*args, shared=False))
        batch = _step(model, ids, dlogits)
    assert np.array_equal(shared[0], batch[0])
    assert all(np.array_equal(shared[1][name], batch[1][name]) for name in batch[1])


def test_split_gives_the_same_bits_at_any_timing(monkeypatch):
    """Shares in worker threads, their gradients added in share order: bit-identical runs.

    The workers' order of finishing is forced both ways by delaying one share.
    """
    model = Decoder(_config("qwen3"), rng=1, dtype=np.float32)
    ids, dlogits = _inputs()
    original = kernel.block_backward
    results = []
    for slow in (0, 1, None):
        def delayed(dy, cache, slow=slow):  # share 0 runs in the calling thread (workers.Crew)
            in_caller = threading.current_thread() is threading.main_thread()
            if slow is not None and in_caller == (slow == 0):
                threading.Event().wait(0.02)
            return original(dy, cache)

        monkeypatch.setattr(kernel, "block_backward", delayed)
        with num_threads(2), block_sizes(batch_split_flops=0):
            results.append(_step(model, ids, dlogits))
            assert len(model._used_cache[2].shares) == 2
    for logits, grads in results[1:]:
        assert np.array_equal(logits, results[0][0])
        assert all(np.array_equal(grads[name], results[0][1][name]) for name in grads)


def test_the_shares_gradients_added_on_the_worker_threads_give_the_serial_bits(monkeypatch):
    """Oracle: the same split step with the shares' gradients added (and the blocks'
    weights copied) in the calling thread, bitwise: each array is added in share order
    whichever thread adds it."""
    model = Decoder(_config("qwen3"), rng=1, dtype=np.float32)
    ids, dlogits = _inputs()
    handed = []
    original = kernel.run

    def spy(task, work, flops=None):
        handed.append(task.__name__)
        return original(task, work, flops)

    monkeypatch.setattr(kernel, "run", spy)
    monkeypatch.setattr(_runtime, "run", spy)  # the weights' copies
    results = []
    for entries in (1 << 40, 0):
        handed.clear()
        with num_threads(2), block_sizes(batch_split_flops=0, min_parallel_entries=entries):
            results.append(_step(model, ids, dlogits))
        assert ("add" in handed and "copy" in handed) == (entries == 0)
    assert np.array_equal(results[0][0], results[1][0])
    assert all(np.array_equal(results[0][1][name], results[1][1][name]) for name in results[0][1])


def test_a_refused_backward_changes_nothing():
    model = Decoder(_config("qwen3"), rng=1, dtype=np.float32)
    ids, dlogits = _inputs()
    model.zero_grad()
    model.forward(ids)
    with pytest.raises(ValueError):
        model.backward(np.full((B, T, V), np.nan, np.float32))
    assert all(not grad.any() for grad in model.grads.values())
    model.backward(dlogits.astype(np.float32))  # the cache is still there
    assert any(grad.any() for grad in model.grads.values())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_dlogits_tested_finite_in_the_shares(threads, bad):
    """Oracle: the whole-array test the backward made before the shares did it (the
    same ValueError naming dlogits), for one entry in the last share's rows; the
    refused call accumulates nothing, and the cache stays for a finite dlogits, whose
    gradients equal a step that never saw the refusal."""
    model = Decoder(_config("qwen3"), rng=1, dtype=np.float32)
    ids, dlogits = _inputs()
    dlogits = dlogits.astype(np.float32)
    poisoned = dlogits.copy()
    poisoned[-1, -1, -1] = bad
    with num_threads(threads), block_sizes(batch_split_flops=0):
        expected = _step(model, ids, dlogits)[1]
        model.zero_grad()
        model.forward(ids)
        assert model._cache[2].head is not None  # the head's backward in the shares
        assert len(model._cache[2].shares) == threads
        with pytest.raises(ValueError, match="^dlogits contains NaN or inf"):
            model.backward(poisoned)
        assert all(not grad.any() for grad in model.grads.values())
        model.backward(dlogits)
    assert all(np.array_equal(model.grads[name], expected[name]) for name in expected)


def test_dlogits_cast_to_inf_is_named_before_the_shares():
    """A float64 dlogits beyond float32's range: the whole-array test of the cast still
    says that the cast made the inf (the shares' test only sees the cast array)."""
    model = Decoder(_config("qwen3"), rng=1, dtype=np.float32)
    ids, dlogits = _inputs()
    dlogits[0, 0, 0] = 1e300
    model.forward(ids)
    with pytest.raises(ValueError, match="too large for float32"):
        model.backward(dlogits)


def test_two_threads_training_one_model():
    """Each thread's forward and backward use its own cache; the gradients add as if serial."""
    model = Decoder(_config("qwen3"), rng=1, dtype=np.float32)
    inputs = [_inputs(seed) for seed in (3, 4)]
    model.zero_grad()
    for ids, dlogits in inputs:
        model.forward(ids)
        model.backward(dlogits.astype(np.float32))
    serial = {name: grad.copy() for name, grad in model.grads.items()}
    model.zero_grad()
    barrier = threading.Barrier(2)
    errors = []

    def train(ids, dlogits):
        try:
            model.forward(ids)
            barrier.wait()  # both forwards done before either backward
            model.backward(dlogits.astype(np.float32))
        except BaseException as error:  # noqa: BLE001 -- reported below
            errors.append(error)

    workers = [threading.Thread(target=train, args=pair) for pair in inputs]
    with num_threads(2), block_sizes(batch_split_flops=0):  # process-wide settings: set once
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    assert not errors
    for name, grad in model.grads.items():
        _close(grad, serial[name], np.float32)


def test_retain_cache_gives_the_same_gradients_twice():
    model = Decoder(_config("qwen3"), rng=1, dtype=np.float32)
    ids, dlogits = _inputs()
    once = _step(model, ids, dlogits)[1]
    model.zero_grad()
    model.forward(ids)
    model.backward(dlogits.astype(np.float32), retain_cache=True)
    model.backward(dlogits.astype(np.float32))
    for name, grad in model.grads.items():
        _close(grad, 2 * once[name], np.float32)
