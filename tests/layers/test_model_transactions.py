"""A composite's call is a transaction: a refused forward, backward or decode
of a model changes nothing.

Oracles, each bitwise:

- the uninterrupted run: the same model (a deep copy made before the refused
  call) running only the accepted calls gives the same gradients, the same
  next backward, the same KV caches and the same dropout masks;
- the state before the call: gradients, caches' lengths and Generators'
  states are equal to what they were before the refused call.

The refusals are real ones (a bad dropout mask in the last block, a NaN
weight read late, an overflow in float32) and planted ones (a sub-layer
that raises, ``KeyboardInterrupt`` half-way through a backward), and the
mechanism is that of :class:`qkvnp.layers.Model`, so a user's own model
inherits it: tested on one below.
"""
import copy
import threading

import numpy as np
import pytest

import qkvnp
from qkvnp.layers import Linear, Model

PATHS = ["reference", "fast", "tiled", "auto"]


def _gpt(impl="auto", dropout=0.0, dtype=np.float64, **options):
    return qkvnp.GPTModel(vocab_size=13, context_length=12, emb_dim=8, num_heads=2, num_layers=3,
                          dropout=dropout, rng=0, dtype=dtype, impl=impl, **options)


def _grads(model):
    return {name: g.copy() for name, g in model.grads.items()}


def _assert_same(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _state(cache):
    return cache.start, len(cache), None if cache.key is None else cache.key.copy()


class Planted(Exception):
    """The failure a test plants in a sub-layer."""


def _plant(layer, method, exc=Planted):
    """Make ``layer.method`` raise ``exc`` (an instance attribute shadows the class's)."""
    def refuse(*args, **kwargs):
        raise exc("planted")

    setattr(layer, method, refuse)
    return lambda: delattr(layer, method)


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("path", PATHS)
def test_a_refused_gpt_forward_leaves_the_previous_forward_for_backward(path):
    # the case: a bad dropout mask for the last block is refused after
    # every earlier block ran and kept its cache
    rng = np.random.default_rng(0)
    model = _gpt(path, dropout=0.1).eval()
    idx, other = rng.integers(0, 13, (2, 5)), rng.integers(0, 13, (2, 5))
    dlogits = rng.normal(size=(2, 5, 13))
    model.forward(idx)
    twin = copy.deepcopy(model)
    twin.forward(idx)
    bad = {"trf_blocks.2.drop_shortcut2": np.ones((2, 5, 7), bool)}  # (B, T, E) expected
    with pytest.raises(ValueError):
        model.forward(other, dropout_masks=bad)
    model.backward(dlogits)
    twin.backward(dlogits)
    _assert_same(_grads(model), _grads(twin))


def test_a_nan_weight_read_late_refuses_the_forward_and_changes_nothing():
    rng = np.random.default_rng(1)
    model = _gpt()
    idx = rng.integers(0, 13, (2, 5))
    dlogits = rng.normal(size=(2, 5, 13))
    model.forward(idx)
    twin = copy.deepcopy(model)
    twin.forward(idx)
    scale = model.final_norm.params["scale"]
    scale[0] = np.nan  # read by the final norm, after every block kept its cache
    with pytest.raises(ValueError, match="scale"):
        model.forward(rng.integers(0, 13, (2, 5)))
    scale[0] = 1.0
    model.backward(dlogits)
    twin.backward(dlogits)
    _assert_same(_grads(model), _grads(twin))


def test_a_refused_block_forward_keeps_its_sub_layers_caches():
    rng = np.random.default_rng(2)
    block = qkvnp.TransformerBlock(8, 2, dropout=0.2, rng=0).eval()
    x, dout = rng.normal(size=(2, 4, 8)), rng.normal(size=(2, 4, 8))
    block.forward(x)
    twin = copy.deepcopy(block)
    twin.forward(x)
    with pytest.raises(ValueError):
        block.forward(2 * x, dropout_masks={"drop_shortcut2": np.ones((3,), bool)})
    np.testing.assert_array_equal(block.backward(dout), twin.backward(dout))
    _assert_same(_grads(block), _grads(twin))


def test_a_refused_training_forward_draws_no_dropout_mask():
    # oracle: the masks drawn after the refused call are those drawn without it
    rng = np.random.default_rng(3)
    model, twin = _gpt(dropout=0.3), _gpt(dropout=0.3)
    idx = rng.integers(0, 13, (2, 5))
    states = {name: g.bit_generator.state for name, g in model.generators().items()}
    restore = _plant(model.final_norm, "forward")  # after every dropout site drew
    with pytest.raises(Planted):
        model.forward(idx)
    restore()
    assert {name: g.bit_generator.state for name, g in model.generators().items()} == states
    np.testing.assert_array_equal(model.forward(idx), twin.forward(idx))


# ---------------------------------------------------------------- backward


@pytest.mark.parametrize("exc", [Planted, KeyboardInterrupt])
def test_a_refused_gpt_backward_adds_no_gradient_and_keeps_every_cache(exc):
    # refused in the sub-layer the backward reaches last: every other gradient
    # was computed first, and none of them may be added
    rng = np.random.default_rng(4)
    model = _gpt()
    idx, dlogits = rng.integers(0, 13, (2, 5)), rng.normal(size=(2, 5, 13))
    model.forward(idx)
    model.backward(dlogits, retain_cache=True)  # gradients that are not zero
    before = _grads(model)
    twin = copy.deepcopy(model)
    twin.forward(idx)
    restore = _plant(model.trf_blocks[0].norm1, "backward", exc)
    with pytest.raises(exc):
        model.backward(dlogits)
    restore()
    _assert_same(_grads(model), before)
    model.backward(dlogits)  # the caches are all still there: the retry is the whole backward
    twin.backward(dlogits)
    _assert_same(_grads(model), _grads(twin))


def test_an_overflowing_float32_backward_adds_no_gradient():
    rng = np.random.default_rng(5)
    model = _gpt(dtype=np.float32)
    idx = rng.integers(0, 13, (2, 5))
    model.forward(idx)
    before = _grads(model)
    huge = np.full((2, 5, 13), 3e38, np.float32)  # finite; the block gradients overflow
    with pytest.raises(ValueError, match="NaN or inf"), np.errstate(all="ignore"):
        model.backward(huge)
    _assert_same(_grads(model), before)
    model.backward(np.ones((2, 5, 13), np.float32))  # the forward's caches were kept


def test_two_threads_backwards_add_as_if_serial_with_refusals_between():
    # oracle: the gradient of one accepted pair, times the number of accepted
    # pairs; one thread's backwards are refused in the sub-layer reached last
    rng = np.random.default_rng(6)
    model = _gpt()
    idx, dlogits = rng.integers(0, 13, (2, 5)), rng.normal(size=(2, 5, 13))
    single = copy.deepcopy(model)
    single.forward(idx)
    single.backward(dlogits)
    rounds, errors, refusing = 6, [], threading.local()
    norm1 = model.trf_blocks[0].norm1
    backward = norm1.backward

    def refuse_in_one_thread(*args, **kwargs):
        if getattr(refusing, "on", False):
            raise Planted("planted")
        return backward(*args, **kwargs)

    norm1.backward = refuse_in_one_thread

    def work(refuse):
        try:
            for _ in range(rounds):
                model.forward(idx)
                if refuse:  # a refused backward, then the accepted one of the same forward
                    refusing.on = True
                    with pytest.raises(Planted):
                        model.backward(dlogits)
                    refusing.on = False
                model.backward(dlogits)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(refuse,)) for refuse in (False, True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for name, grad in single.grads.items():
        np.testing.assert_allclose(model.grads[name], 2 * rounds * grad, rtol=1e-12,
                                   atol=1e-14, err_msg=name)


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("options", [{}, {"rope": True, "window": (2, 0)}],
                         ids=["plain", "rope-window"])
def test_a_refused_decode_leaves_every_blocks_cache_as_it_was(options):
    rng = np.random.default_rng(7)
    model = _gpt(**options)
    idx = rng.integers(0, 13, (2, 6))
    caches = [qkvnp.KVCache() for _ in range(model.num_layers)]
    model.decode(idx[:, :3], caches)
    before = [_state(cache) for cache in caches]
    scale = model.trf_blocks[1].norm2.params["scale"]
    saved = scale.copy()
    scale[:] = np.inf  # block 1 refuses, after block 0 appended its keys
    with pytest.raises(ValueError, match="NaN or inf"), np.errstate(all="ignore"):
        model.decode(idx[:, 3:4], caches)
    scale[:] = saved
    for cache, (start, length, key) in zip(caches, before):
        assert (cache.start, len(cache)) == (start, length)
        np.testing.assert_array_equal(cache.key, key)
    # the retry gives what one forward over the whole sequence gives
    steps = [model.decode(idx[:, t:t + 1], caches) for t in range(3, 6)]
    full = model.forward(idx)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full[:, 3:], rtol=1e-12,
                               atol=1e-12)


def test_decode_refuses_what_is_not_a_kv_cache():
    model = _gpt()
    with pytest.raises(TypeError, match="kv_caches must be a sequence of one qkvnp.KVCache"):
        model.decode(np.array([[1, 2]]), qkvnp.KVCache())
    with pytest.raises(TypeError, match=r"kv_caches\[1\] must be a qkvnp.KVCache, got dict"):
        model.decode(np.array([[1, 2]]), [qkvnp.KVCache(), {}, qkvnp.KVCache()])


@pytest.mark.parametrize("build", [
    lambda flag: _gpt(qkv_bias=flag),
    lambda flag: qkvnp.TransformerBlock(8, 2, qkv_bias=flag),
], ids=["GPTModel", "TransformerBlock"])
def test_qkv_bias_must_be_a_bool(build):
    # bool("False") is True: the string once built the biases
    with pytest.raises(TypeError, match="qkv_bias must be a bool, got str 'False'"):
        build("False")
    assert "trf_blocks.0.att.b_query" not in getattr(build(False), "params")


# ---------------------------------------------------------------- a user's model


class TwoLinears(Model):
    """A model of the user's: its forward refuses after its first sub-layer ran."""

    def __init__(self):
        self.first = Linear(4, 3, rng=0)
        self.second = Linear(3, 2, rng=1)
        self.zero_grad()

    def forward(self, x, *, refuse=False):
        h = self.first.forward(x)
        if refuse:
            raise ValueError("refused after the first sub-layer")
        return self.second.forward(h)

    def backward(self, dout, retain_cache=False):
        dh = self.second.backward(dout, retain_cache)
        return self.first.backward(dh, retain_cache)


def test_a_users_model_inherits_the_transaction():
    rng = np.random.default_rng(8)
    model = TwoLinears()
    x, dout = rng.normal(size=(5, 4)), rng.normal(size=(5, 2))
    model.forward(x)
    twin = copy.deepcopy(model)
    twin.forward(x)
    with pytest.raises(ValueError, match="refused"):
        model.forward(2 * x, refuse=True)
    restore = _plant(model.first, "backward")
    with pytest.raises(Planted):
        model.backward(dout)  # the second layer's gradients were computed, not added
    restore()
    _assert_same(_grads(model), {name: np.zeros_like(g) for name, g in model.grads.items()})
    np.testing.assert_array_equal(model.backward(dout), twin.backward(dout))
    _assert_same(_grads(model), _grads(twin))


def test_a_commit_on_the_worker_threads_adds_the_serial_bits(monkeypatch):
    """Oracle: the same backward committed in the calling thread, bitwise. From
    ``min_parallel_entries`` on the kept gradients are dealt among the worker threads
    by target; a tied table's two gradients (its lookup's and the head's) stay one
    group, added in the order they came."""
    from qkvnp.kernels import _runtime, block_sizes, num_threads
    from qkvnp.layers import transaction
    from qkvnp.models.decoder import Decoder, DecoderConfig

    config = DecoderConfig.gpt2(vocab_size=29, emb_dim=16, num_layers=2, num_heads=2,
                                context_length=8)
    model = Decoder(config, rng=0)
    ids = np.random.default_rng(1).integers(0, 29, (2, 8))
    dlogits = np.random.default_rng(2).standard_normal((2, 8, 29))
    handed = []
    real_run = _runtime.run
    monkeypatch.setattr(_runtime, "run", lambda task, work, flops=None: (
        handed.append([[t for t, _ in group] for group in work]) if task.__name__ == "add"
        else None, real_run(task, work, flops))[1])
    results = []
    for entries in (1 << 40, 0):
        handed.clear()
        model.zero_grad()
        model.forward(ids)
        with num_threads(2), block_sizes(min_parallel_entries=entries):
            model.backward(dlogits)
        results.append(_grads(model))
        assert bool(handed) == (entries == 0)
    table = model.embed.grads["weight"]
    assert any(len(group) == 2 and all(t is table for t in group) for group in handed[0])
    _assert_same(results[1], results[0])
    assert transaction._GRADS_LOCK.acquire(blocking=False)  # released after the commit
    transaction._GRADS_LOCK.release()
