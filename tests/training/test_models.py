"""Models: gradients of every variant by qkvnp.gradcheck, shared arrays, ties, errors.

Oracles: central differences (:func:`qkvnp.gradcheck.check_layer`, float64,
random upstream gradients) for every parameter of every variant; object
identity for the arrays shared between a model and its layers; a hand
computation of the forward from the parameters for the kv-recall model.
"""
import numpy as np
import pytest

from qkvnp.gradcheck import check_layer
from qkvnp.training.models import VARIANTS, AttentionRegressor, KVRecallModel
from qkvnp.optim import SGD
from qkvnp.training.tasks import KVRecallTask


class FixedBatch:
    """Adapter for check_layer: kv-recall's inputs are integer ids, not perturbable floats.

    ``forward`` ignores its (float) argument and runs the model on a fixed batch,
    so that the checker perturbs the parameters only.
    """

    def __init__(self, model, batch):
        self.model, self.batch = model, batch

    @property
    def params(self):
        return self.model.params

    @property
    def grads(self):
        return self.model.grads

    def zero_grad(self):
        self.model.zero_grad()

    def forward(self, _unused):
        return self.model.forward(self.batch.keys, self.batch.values, self.batch.query)

    def backward(self, dlogits):
        return self.model.backward(dlogits)


def kv_batch(B=5, num_keys=7, num_values=5, P=4, seed=0):
    return KVRecallTask(num_keys, num_values, P).sample(np.random.default_rng(seed), B)


# separate, tied_qk, no_value, shared; 40 keys: the key table's backward forms the
# items' gradient (2 x 40 folded columns > P x E = 24), the value table's folds it
@pytest.mark.parametrize("variant, num_keys", [(v, 7) for v in VARIANTS] + [("separate", 40)])
def test_kv_recall_gradients_match_central_differences(variant, num_keys):
    model = KVRecallModel(num_keys, 5, 6, variant=variant, rng=1)
    report = check_layer(FixedBatch(model, kv_batch(num_keys=num_keys)), np.zeros(1),
                         wrt_inputs=False)
    assert report.ok, report.table()
    checked = {row.split(" ", 1)[1] for row in (r.name for r in report.rows)}
    assert checked == set(model.params)  # every parameter, each tied matrix once


@pytest.mark.parametrize("variant", ["tied_qk", "shared"])
def test_a_tied_matrix_gets_the_sum_of_its_uses_gradients(variant):
    # oracle: the tied model's gradient equals the sum of the separate model's
    # gradients of the roles it plays, when the separate matrices hold its values
    batch = kv_batch(seed=3)
    tied = KVRecallModel(7, 5, 6, variant=variant, rng=2)
    separate = KVRecallModel(7, 5, 6, variant="separate", rng=2)
    tied_name = "attention.W_qk" if variant == "tied_qk" else "attention.W_shared"
    roles = ["W_query", "W_key"] + (["W_value"] if variant == "shared" else [])
    for name, value in tied.params.items():
        if name.startswith("attention."):
            continue
        separate.params[name][...] = value
    for role in roles:
        separate.params["attention." + role][...] = tied.params[tied_name]
    if variant == "tied_qk":
        separate.params["attention.W_value"][...] = tied.params["attention.W_value"]
    dlogits = np.random.default_rng(4).standard_normal((5, 5))
    for model in (tied, separate):
        model.zero_grad()
        model.forward(batch.keys, batch.values, batch.query)
        model.backward(dlogits)
    np.testing.assert_allclose(tied.grads[tied_name],
                               sum(separate.grads["attention." + r] for r in roles), rtol=1e-12)


def test_kv_recall_forward_matches_a_hand_computation():
    # oracle: the formula of the docstring written with plain numpy
    model = KVRecallModel(7, 5, 6, rng=0)
    batch = kv_batch()
    p = model.params
    items = p["embed_key.weight"][batch.keys] + p["embed_value.weight"][batch.values]  # (B, P, E)
    query = p["embed_key.weight"][batch.query] + p["query_marker"]  # (B, E)
    q, k, v = query @ p["attention.W_query"], items @ p["attention.W_key"], items @ p["attention.W_value"]
    scores = np.einsum("be,bpe->bp", q, k) / np.sqrt(6)
    weights = np.exp(scores - scores.max(1, keepdims=True))
    weights /= weights.sum(1, keepdims=True)
    expected = np.einsum("bp,bpe->be", weights, v) @ p["readout.W"] + p["readout.b"]
    logits, got_weights = model.forward(batch.keys, batch.values, batch.query, return_weights=True)
    assert logits.shape == (5, 5) and got_weights.shape == (5, 4)
    np.testing.assert_allclose(logits, expected, rtol=1e-12)
    np.testing.assert_allclose(got_weights, weights, rtol=1e-12)


class FixedMask(FixedBatch):
    """FixedBatch whose every forward draws the same dropout mask (the rng's state restored)."""

    def __init__(self, model, batch):
        super().__init__(model, batch)
        self.state = model.dropout_rng.bit_generator.state

    def forward(self, _unused):
        self.model.dropout_rng.bit_generator.state = self.state
        return super().forward(_unused)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kv_recall_with_dropout_matches_the_unfolded_formula_and_central_differences(variant):
    """Oracles: the docstring's unfolded formula (K and V formed) with the very
    weights the model dropped, and central differences with the mask held
    fixed; the model itself folds W_key and W_value onto the query."""
    model = KVRecallModel(7, 5, 6, variant=variant, rng=3, dropout=0.5)
    batch = kv_batch(B=6)
    adapter = FixedMask(model, batch)
    logits = adapter.forward(None)
    model.dropout_rng.bit_generator.state = adapter.state
    _, dropped = model.forward(batch.keys, batch.values, batch.query, return_weights=True)
    assert (dropped == 0).any() and (dropped > 1).any()  # some weights dropped, the rest scaled by 2
    p, (role_q, role_k, role_v) = model.params, model.roles
    items = p["embed_key.weight"][batch.keys] + p["embed_value.weight"][batch.values]  # (B, P, E)
    query = p["embed_key.weight"][batch.query] + p["query_marker"]  # (B, E)
    v = items if role_v is None else items @ p[role_v]  # (B, P, E)
    expected = np.einsum("bp,bpe->be", dropped, v) @ p["readout.W"] + p["readout.b"]
    np.testing.assert_allclose(logits, expected, rtol=1e-12)
    k, q = items @ p[role_k], query @ p[role_q]
    scores = np.einsum("be,bpe->bp", q, k) / np.sqrt(6)
    kept = dropped != 0  # where kept, the dropped weight is softmax / (1 - p)
    softmax = np.exp(scores - scores.max(1, keepdims=True))
    softmax /= softmax.sum(1, keepdims=True)
    np.testing.assert_allclose(dropped[kept], 2 * softmax[kept], rtol=1e-12)
    report = check_layer(adapter, np.zeros(1), wrt_inputs=False)
    assert report.ok, report.table()


def test_no_value_variant_returns_the_items_themselves():
    # oracle: with one stored pair, attention returns that item unprojected
    model = KVRecallModel(4, 3, 5, variant="no_value", rng=0)
    keys, values, query = np.array([[2]]), np.array([[1]]), np.array([2])
    model.forward(keys, values, query)
    p = model.params
    item = p["embed_key.weight"][2] + p["embed_value.weight"][1]
    np.testing.assert_allclose(model.forward(keys, values, query),
                               (item @ p["readout.W"] + p["readout.b"])[None], rtol=1e-12)


@pytest.mark.parametrize("variant, matrices", [
    ("separate", ["W_key", "W_query", "W_value"]),
    ("tied_qk", ["W_qk", "W_value"]),
    ("no_value", ["W_key", "W_query"]),
    ("shared", ["W_shared"]),
])
def test_variants_own_the_expected_matrices(variant, matrices):
    model = KVRecallModel(7, 5, 6, variant=variant, rng=0)
    names = sorted(n.split(".", 1)[1] for n in model.params if n.startswith("attention."))
    assert names == matrices


def test_params_share_the_layers_arrays_so_an_optimizer_trains_them():
    model = KVRecallModel(7, 5, 6, rng=0)
    assert model.params["embed_key.weight"] is model.embed_key.params["weight"]
    assert model.params["readout.W"] is model.readout.params["W"]
    batch = kv_batch()
    before = model.forward(batch.keys, batch.values, batch.query).copy()
    optimizer = SGD(model.params, lr=0.1)
    model.zero_grad()
    model.forward(batch.keys, batch.values, batch.query)
    model.backward(np.ones((5, 5)))
    readout_before = model.readout.params["W"].copy()
    optimizer.step(model.grads)
    # the sub-layer sees the update: its array was changed in place
    np.testing.assert_allclose(model.readout.params["W"],
                               readout_before - 0.1 * model.grads["readout.W"], rtol=1e-12)
    assert not np.allclose(model.forward(batch.keys, batch.values, batch.query), before)


def test_backward_accumulates_and_zero_grad_resets():
    # oracle: two backward passes give twice the gradient of one
    model = KVRecallModel(7, 5, 6, variant="tied_qk", rng=0)
    batch = kv_batch()
    dlogits = np.random.default_rng(1).standard_normal((5, 5))
    model.forward(batch.keys, batch.values, batch.query)
    model.backward(dlogits, retain_cache=True)
    once = {name: g.copy() for name, g in model.grads.items()}
    model.backward(dlogits)
    for name in once:
        np.testing.assert_allclose(model.grads[name], 2 * once[name], rtol=1e-12)
    model.zero_grad()
    assert all(not g.any() for g in model.grads.values())
    assert sorted(model.grads) == sorted(model.params)


def test_float32_model_computes_in_float32():
    model = KVRecallModel(7, 5, 6, rng=0, dtype=np.float32)
    batch = kv_batch()
    logits = model.forward(batch.keys, batch.values, batch.query)
    assert logits.dtype == np.float32
    model.backward(np.ones((5, 5), dtype=np.float32))
    assert all(g.dtype == np.float32 for g in model.grads.values())


def test_attention_regressor_gradients_match_central_differences():
    student = AttentionRegressor(6, 2, rng=0)
    x = np.random.default_rng(1).standard_normal((2, 3, 6))
    report = check_layer(student, x)
    assert report.ok, report.table()
    assert student.params["attention.W_out"] is student.attention.params["W_out"]


@pytest.mark.parametrize("args, error, match", [
    # (keys, values, query) -> error
    ((np.array([[1, 2]]), np.array([[1, 2]]), np.array([1.0])), TypeError, "query must hold integer"),
    ((np.array([[1, 2]]), np.array([[1, 2, 0]]), np.array([1])), ValueError,
     r"values must have the shape of keys \(1, 2\), got shape \(1, 3\)"),
    ((np.array([[1, 2]]), np.array([[1, 2]]), np.array([1, 2])), ValueError,
     r"query must have shape \(1,\) \(B,\), got shape \(2,\)"),
    ((np.array([1, 2]), np.array([1, 2]), np.array([1])), ValueError,
     r"keys must have shape \(B, P\), got shape \(2,\)"),
    ((np.array([[1, 9]]), np.array([[1, 2]]), np.array([1])), ValueError, r"in \[0, 7\)"),
])
def test_bad_input_names_the_argument(args, error, match):
    model = KVRecallModel(7, 5, 6, rng=0)
    with pytest.raises(error, match=match):
        model.forward(*args)


def test_bad_construction_and_backward_before_forward():
    with pytest.raises(ValueError, match="variant must be one of"):
        KVRecallModel(7, 5, 6, variant="qk_only")
    model = KVRecallModel(7, 5, 6, rng=0)
    with pytest.raises(RuntimeError, match="backward called before forward"):
        model.backward(np.ones((5, 5)))
    model.forward(*kv_batch()[:3])
    with pytest.raises(ValueError, match=r"dlogits must have shape \(5, 5\)"):
        model.backward(np.ones((5, 1)))


@pytest.mark.parametrize("bad, error, match", [
    (np.nan, ValueError, "dlogits contains NaN or inf"),
    (np.inf, ValueError, "dlogits contains NaN or inf"),
    (1j, TypeError, "dlogits must hold real numbers"),
])
def test_bad_dlogits_is_refused_by_name_and_leaves_grads_alone(bad, error, match):
    # oracle: the error names the user's argument (not the "dout" of a layer
    # inside), and nothing was accumulated before it was raised
    model = KVRecallModel(7, 5, 6, rng=0)
    model.forward(*kv_batch()[:3])
    before = {name: g.copy() for name, g in model.grads.items()}
    dlogits = np.ones((5, 5), dtype=np.result_type(type(bad), np.float64))
    dlogits[2, 3] = bad
    with pytest.raises(error, match=match):
        model.backward(dlogits)
    assert all(np.array_equal(model.grads[name], before[name]) for name in before)
