"""state_dict / load_state_dict on every layer, and qkvnp.Model as a container.

Oracles: object identity (loading writes into the layer's own arrays; a
model's params are its sub-layers' arrays), exact equality of round trips,
the error messages' named keys, and for a plain ``Model`` a hand-written
sum of the layers' gradients.
"""
import math

import numpy as np
import pytest

import qkvnp
from qkvnp import Embedding, Linear, Model, MultiHeadAttention, SelfAttention
from qkvnp.optim import SGD
from qkvnp.training.models import AttentionRegressor, KVRecallModel

LAYERS = {  # name -> factory; one of each layer and model
    "Linear": lambda dtype: Linear(3, 2, rng=0, dtype=dtype),
    "Embedding": lambda dtype: Embedding(5, 3, rng=0, dtype=dtype),
    "SelfAttention": lambda dtype: SelfAttention(3, 2, qkv_bias=True, rng=0, dtype=dtype),
    "MultiHeadAttention": lambda dtype: MultiHeadAttention(4, 2, qdim=3, kdim=5, vdim=6,
                                                           out_dim=7, rng=0, dtype=dtype),
    "KVRecallModel": lambda dtype: KVRecallModel(5, 4, 6, rng=0, dtype=dtype),
    "AttentionRegressor": lambda dtype: AttentionRegressor(4, 2, rng=0, dtype=dtype),
}


@pytest.mark.parametrize("make", LAYERS.values(), ids=list(LAYERS))
def test_state_dict_copies_and_load_writes_in_place(make):
    layer, other = make(np.float64), make(np.float64)
    arrays = dict(layer.params)  # the arrays an optimizer would hold
    state = other.state_dict()
    assert list(state) == list(other.params)
    for name, value in state.items():
        assert value is not other.params[name] and np.array_equal(value, other.params[name])
        value += 1.0  # a copy: the layer does not change
        assert not np.array_equal(value, other.params[name])
    assert layer.load_state_dict(other.state_dict()) == ([], [])
    for name, value in layer.params.items():
        assert value is arrays[name], f"{name} was replaced, not written into"
        assert np.array_equal(value, other.params[name]), name


@pytest.mark.parametrize("make", LAYERS.values(), ids=list(LAYERS))
def test_load_casts_to_the_layers_dtype(make):
    layer = make(np.float32)
    state = {name: value.astype(np.float64) / 3 for name, value in make(np.float64).params.items()}
    layer.load_state_dict(state)
    for name, value in layer.params.items():
        assert value.dtype == np.float32
        assert np.array_equal(value, state[name].astype(np.float32)), name


def test_missing_and_unexpected_keys_are_listed_and_nothing_is_written():
    layer = MultiHeadAttention(4, 2, rng=0)
    before = layer.state_dict()
    state = layer.state_dict()
    del state["b_out"]
    state["W_extra"] = np.ones(2)
    with pytest.raises(ValueError, match=r"missing keys \['b_out'\], unexpected keys \['W_extra'\]"):
        layer.load_state_dict({name: value + 1 for name, value in state.items()})
    for name, value in layer.params.items():
        assert np.array_equal(value, before[name]), name
    result = layer.load_state_dict({name: value + 1 for name, value in state.items()},
                                   strict=False)
    assert result.missing_keys == ["b_out"] and result.unexpected_keys == ["W_extra"]
    assert np.array_equal(layer.params["W_out"], before["W_out"] + 1)
    assert np.array_equal(layer.params["b_out"], before["b_out"])  # missing: left as it was


@pytest.mark.parametrize("bad, error, match", [
    (np.ones((4, 3)), ValueError, r"state_dict\['W_out'\] must have shape \(4, 4\), got shape \(4, 3\)"),
    (np.full((4, 4), np.nan), ValueError, r"state_dict\['W_out'\] contains NaN or inf"),
    (np.full((4, 4), 1e300), ValueError, r"state_dict\[.W_out.\] has values too large for float32"),  # inf in float32
    (np.ones((4, 4), complex), TypeError, r"state_dict\['W_out'\]"),
    (None, TypeError, r"state_dict\['W_out'\] must be an array, got None"),
])
def test_bad_values_are_refused_naming_the_key(bad, error, match):
    layer = MultiHeadAttention(4, 2, rng=0, dtype=np.float32)
    before = layer.state_dict()
    state = layer.state_dict()
    state["b_query"] = state["b_query"] + 1  # would be written first: must not be
    state["W_out"] = bad
    with pytest.raises(error, match=match):
        layer.load_state_dict(state)
    for name, value in layer.params.items():
        assert np.array_equal(value, before[name]), name
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        layer.load_state_dict([("W_out", np.ones((4, 4)))])


def test_model_registers_layers_by_assignment_sharing_arrays():
    model = Model()
    model.attn = MultiHeadAttention(8, 2, rng=0)
    model.head = Linear(8, 3, rng=1)
    assert list(model.params) == ([f"attn.{n}" for n in model.attn.params]
                                  + ["head.W", "head.b"])
    for name, value in model.attn.params.items():
        assert model.params[f"attn.{name}"] is value  # the array itself, not a copy
    # one optimizer over the model trains both layers in place
    x = np.random.default_rng(0).standard_normal((2, 5, 8))
    dout = np.random.default_rng(1).standard_normal((2, 5, 3))
    assert model.head.forward(model.attn.forward(x)).shape == (2, 5, 3)
    model.attn.backward(model.head.backward(dout))
    # oracle: db = sum dY, each column's exact sum (math.fsum), within float64's
    # rounding of a 10-term sum (the layer sums in another order than numpy)
    rows = dout.reshape(-1, 3)
    exact = [math.fsum(column) for column in rows.T]
    bound = len(rows) * np.finfo(float).eps * np.abs(rows).sum(axis=0)  # n eps sum|x|
    assert np.all(np.abs(model.grads["head.b"] - exact) <= bound)
    assert model.grads["attn.W_query"] is model.attn.grads["W_query"]
    W_query = model.attn.params["W_query"].copy()
    SGD(model.params, lr=0.1).step(model.grads)
    assert np.array_equal(model.attn.params["W_query"], W_query - 0.1 * model.attn.grads["W_query"])
    model.zero_grad()
    assert all(not grad.any() for grad in model.grads.values())
    assert all(not grad.any() for grad in model.attn.grads.values())
    with pytest.raises(NotImplementedError, match="subclass qkvnp.Model"):
        model.forward(x)


def test_models_nest_and_reassigning_or_deleting_unregisters():
    inner = Model()
    inner.attn = SelfAttention(3, 2, rng=0)
    outer = Model()
    outer.block = inner
    outer.head = Linear(2, 2, rng=0)
    assert list(outer.params) == ["block.attn.W_query", "block.attn.W_key", "block.attn.W_value",
                                  "head.W", "head.b"]
    assert outer.params["block.attn.W_key"] is inner.attn.params["W_key"]
    state = outer.state_dict()
    state["block.attn.W_key"] = np.zeros((3, 2))
    outer.load_state_dict(state)
    assert not inner.attn.params["W_key"].any()
    assert repr(outer).splitlines()[:3] == ["Model(", "  (block): Model(",
                                           "    (attn): SelfAttention(d_in=3, d_out=2, "
                                           "qkv_bias=False, dtype=float64, impl='auto')"]
    outer.head = None
    del outer.block
    assert outer.params == {} and outer.grads == {}
    with pytest.raises(ValueError, match="cannot hold itself"):
        outer.me = outer


def test_training_models_keep_their_names_and_seeded_values():
    """Oracle: the parameter names and order the checkpoints store, and the seeded draws."""
    model = KVRecallModel(5, 4, 6, rng=0)
    assert list(model.params) == ["query_marker", "attention.W_query", "attention.W_key",
                                  "attention.W_value", "embed_key.weight", "embed_value.weight",
                                  "readout.W", "readout.b"]
    rng = np.random.default_rng(0)  # the draws in construction order
    assert np.array_equal(model.params["embed_key.weight"], rng.standard_normal((5, 6)))
    student = AttentionRegressor(4, 2, rng=0)
    assert list(student.params) == [f"attention.{n}" for n in
                                    ("W_query", "W_key", "W_value", "W_out",
                                     "b_query", "b_key", "b_value", "b_out")]
    assert list(student.grads) == list(student.params)
    assert isinstance(student, qkvnp.Model)
