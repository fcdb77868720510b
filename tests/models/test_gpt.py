"""The transformer layers and the GPT against numerical derivatives and closed forms.

Shape key: B batch, T tokens, E embedding, V vocabulary, H heads.

Oracles: central differences and complex step (:mod:`qkvnp.gradcheck`,
float64, random upstream gradients) for every parameter and input gradient
of every new layer and of :class:`qkvnp.GPTModel` under the cross-entropy
loss; causality (changing a later token does not change earlier logits); the
layer contract (state dicts, repr, errors naming the argument).
"""
import numpy as np
import pytest

import qkvnp
from qkvnp import functional as F
from qkvnp.gradcheck import check_layer
from qkvnp.layers import Model
from qkvnp.losses import cross_entropy_backward, cross_entropy_forward

METHODS = ["central", "complex_step"]


def assert_ok(report):
    assert report.rows, "nothing was checked"
    assert report.ok, "\n" + report.table()


class GPTWithLoss(Model):
    """The GPT followed by the mean cross-entropy of the next tokens: a scalar to check."""

    supports_complex_step = True

    def __init__(self, model):
        self.model = model
        self.zero_grad()

    def forward(self, idx, targets):
        logits = self.model.forward(idx)  # (B, T) -> (B, T, V)
        loss, self._loss_cache = cross_entropy_forward(logits, targets)
        return loss

    def backward(self, dloss, retain_cache=False):
        self.model.backward(cross_entropy_backward(dloss, self._loss_cache), retain_cache)
        return None, None


def tiny_gpt(qkv_bias=False, dropout=0.0, impl="auto", **kwargs):
    return qkvnp.GPTModel(vocab_size=11, context_length=6, emb_dim=8, num_heads=2, num_layers=2,
                          dropout=dropout, qkv_bias=qkv_bias, rng=0, impl=impl, **kwargs)


# ------------------------------------------------------------------ gradients


@pytest.mark.parametrize("method", METHODS)
def test_layer_norm_layer_gradients(method, rng):
    norm = qkvnp.LayerNorm(5)
    norm.params["scale"][:] = rng.normal(size=5)  # not the ones/zeros start: a generic point
    norm.params["shift"][:] = rng.normal(size=5)
    assert_ok(check_layer(norm, rng.normal(size=(2, 3, 5)), method=method))


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("method", METHODS)
def test_gelu_and_feed_forward_gradients(approximate, method, rng):
    x = rng.normal(size=(2, 3, 4))
    assert_ok(check_layer(qkvnp.GELU(approximate), x, method=method))
    ff = qkvnp.FeedForward(4, 6, rng=1, approximate=approximate)
    assert_ok(check_layer(ff, x, method=method))


@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_transformer_block_gradients(qkv_bias, method, rng):
    block = qkvnp.TransformerBlock(8, 2, qkv_bias=qkv_bias, rng=0)
    for layer in (block.norm1, block.norm2):  # a generic point, not the ones/zeros start
        layer.params["scale"][:] = 1 + 0.3 * rng.normal(size=8)
        layer.params["shift"][:] = 0.3 * rng.normal(size=8)
    assert_ok(check_layer(block, rng.normal(size=(2, 4, 8)), method=method))


@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_gpt_gradients_under_cross_entropy(qkv_bias, method, rng):
    model = tiny_gpt(qkv_bias)
    for name, value in model.params.items():  # norms off their ones/zeros start
        if "norm" in name:
            value += 0.3 * rng.normal(size=value.shape)
    idx = rng.integers(0, 11, size=(2, 5))
    targets = rng.integers(0, 11, size=(2, 5))
    report = check_layer(GPTWithLoss(model), idx, targets, method=method)
    assert_ok(report)
    assert {row.name for row in report.rows} >= {"param model.pos_emb.weight",
                                                 "param model.out_head.W"}


def test_gpt_gradients_with_replayed_dropout_masks(rng):
    # a fixed mask makes the model a fixed function of its parameters: checkable
    model = tiny_gpt(dropout=0.2)
    masks = {name: rng.random(shape) > 0.2
             for name, shape in model.dropout_mask_shapes((2,), 5).items()}
    idx = rng.integers(0, 11, size=(2, 5))
    assert_ok(check_layer(model, idx, forward_kwargs={"dropout_masks": masks}))


def test_complex_step_perturbs_a_models_parameters():
    # Before Model.params wrote through, the complex step replaced entries of a
    # throw-away dict and saw a derivative of 0; a wrong gradient must be caught.
    # NOTE: a composite's gradients are added when its outermost call returns
    # (qkvnp.layers.transaction), so the bug is planted in what the norm adds
    class DoubledScale(qkvnp.LayerNorm):
        def _accumulate(self, name, grad):
            super()._accumulate(name, 2.0 * grad if name == "scale" else grad)  # planted bug

    class Doubled(GPTWithLoss):
        def __init__(self, model):
            super().__init__(model)
            model.final_norm.__class__ = DoubledScale

    rng = np.random.default_rng(0)
    idx, targets = rng.integers(0, 11, size=(2, 5)), rng.integers(0, 11, size=(2, 5))
    report = check_layer(Doubled(tiny_gpt()), idx, targets, method="complex_step")
    assert not report.row("param model.final_norm.scale").ok
    assert report.row("param model.final_norm.shift").ok


def test_model_params_write_through_and_stay_shared():
    model = tiny_gpt()
    original = model.trf_blocks[1].att.params["W_query"]
    replacement = np.zeros_like(original)
    params = model.params
    params["trf_blocks.1.att.W_query"] = replacement
    assert model.trf_blocks[1].att.params["W_query"] is replacement
    assert params["trf_blocks.1.att.W_query"] is replacement
    with pytest.raises(KeyError, match="no params entry 'nope'"):
        params["nope"] = replacement
    assert type(params) is not dict and isinstance(params, dict)  # optimizers take it
    names = [name for name, _ in model.named_layers()]
    assert "trf_blocks.1.att" in names and "trf_blocks.0.ff.layers.2" in names


# ------------------------------------------------------------------ behaviour


def test_changing_a_later_token_does_not_change_earlier_logits(rng):
    model = tiny_gpt()
    idx = rng.integers(0, 11, size=(2, 6))
    other = idx.copy()
    other[:, 4] = (other[:, 4] + 1) % 11
    a, b = model.forward(idx), model.forward(other)
    assert a.shape == (2, 6, 11)
    np.testing.assert_array_equal(a[:, :4], b[:, :4])
    assert not np.allclose(a[:, 4:], b[:, 4:])


@pytest.mark.parametrize("impl", ["reference", "fast", "tiled"])
def test_every_attention_path_gives_the_same_logits(impl, rng):
    idx = rng.integers(0, 11, size=(3, 6))
    reference = tiny_gpt(impl="reference").forward(idx)
    np.testing.assert_allclose(tiny_gpt(impl=impl).forward(idx), reference, rtol=1e-12,
                               atol=1e-12)


def test_from_config_reads_the_books_keys():
    cfg = {"vocab_size": 11, "context_length": 6, "emb_dim": 8, "n_heads": 2, "n_layers": 2,
           "drop_rate": 0.1, "qkv_bias": True}
    model = qkvnp.GPTModel.from_config(cfg, rng=0)
    assert (model.vocab_size, model.context_length, model.emb_dim, model.num_heads,
            model.num_layers, model.dropout, model.qkv_bias) == (11, 6, 8, 2, 2, 0.1, True)
    assert "trf_blocks.1.att.b_query" in model.params
    with pytest.raises(ValueError, match=r"missing \['qkv_bias'\], unknown \['n_head'\]"):
        qkvnp.GPTModel.from_config({**{k: v for k, v in cfg.items() if k != "qkv_bias"},
                                    "n_head": 2})


def test_too_long_or_bad_ids_are_refused_naming_the_argument():
    model = tiny_gpt()
    with pytest.raises(ValueError, match="context_length=6.*got T=7"):
        model.forward(np.zeros((1, 7), int))
    with pytest.raises(ValueError, match=r"idx must be in \[0, 11\)"):
        model.forward(np.array([[1, 11]]))
    with pytest.raises(TypeError, match="idx must hold integer token ids"):
        model.forward(np.zeros((1, 3)))
    with pytest.raises(ValueError, match="unknown name 'trf_blocks.5.att'"):
        model.forward(np.zeros((1, 3), int), dropout_masks={"trf_blocks.5.att": None})
    model.forward(np.zeros((1, 3), int))
    with pytest.raises(ValueError, match="dlogits"):
        model.backward(np.zeros((1, 3, 10)))


def test_backward_accumulates_and_zero_grad_resets(rng):
    model = tiny_gpt()
    idx = rng.integers(0, 11, size=(2, 4))
    dlogits = rng.normal(size=(2, 4, 11))
    model.forward(idx)
    model.backward(dlogits)
    once = {name: g.copy() for name, g in model.grads.items()}
    model.forward(idx)
    model.backward(dlogits)
    for name, grad in model.grads.items():
        np.testing.assert_allclose(grad, 2 * once[name], rtol=1e-13, atol=1e-300)
    with pytest.raises(RuntimeError, match="backward called twice"):
        model.backward(dlogits)
    model.zero_grad()
    assert all(not g.any() for g in model.grads.values())


def test_state_dict_round_trip_and_train_eval_reach_every_layer(rng):
    source, target = tiny_gpt(dropout=0.1), qkvnp.GPTModel(11, 6, 8, 2, 2, 0.1, rng=5)
    target.load_state_dict(source.state_dict())
    idx = rng.integers(0, 11, size=(2, 5))
    source.eval(), target.eval()
    np.testing.assert_array_equal(source.forward(idx), target.forward(idx))
    assert all(not layer.training for _, layer in target.named_layers())
    target.train()
    assert all(layer.training for _, layer in target.named_layers())
    assert set(target.generators()) >= {"drop_emb.dropout_rng", "trf_blocks.0.att.dropout_rng"}


def test_training_mode_draws_dropout_and_eval_mode_does_not(rng):
    model = tiny_gpt(dropout=0.5)
    idx = rng.integers(0, 11, size=(2, 5))
    assert not np.allclose(model.forward(idx), model.forward(idx))  # two masks drawn
    model.eval()
    np.testing.assert_array_equal(model.forward(idx), model.forward(idx))


def test_layer_constructors_refuse_bad_arguments():
    with pytest.raises(ValueError, match="approximate must be one of"):
        qkvnp.GELU("exact")
    with pytest.raises(ValueError, match="eps must be a finite float > 0"):
        qkvnp.LayerNorm(4, eps=-1.0)
    with pytest.raises(ValueError, match="embed_dim must be divisible by num_heads"):
        qkvnp.TransformerBlock(6, 4)
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., 4\)"):
        qkvnp.LayerNorm(4).forward(np.ones((2, 3)))
    assert repr(qkvnp.LayerNorm(4)) == "LayerNorm(dim=4, eps=1e-05, dtype=float64)"
    assert repr(qkvnp.GELU()) == "GELU(approximate='tanh')"


def test_book_layout_names_and_refusals():
    # oracle: the book's GPTModel.state_dict() keys (ch04 gpt.py), and the transposes of nn.Linear
    from qkvnp.interop import from_torch, to_torch

    model = tiny_gpt(qkv_bias=True)
    state = to_torch(model, "book.GPTModel")
    assert {"tok_emb.weight", "pos_emb.weight", "trf_blocks.1.att.W_query.weight",
            "trf_blocks.1.att.W_key.bias", "trf_blocks.0.att.out_proj.bias",
            "trf_blocks.0.ff.layers.0.weight", "trf_blocks.0.ff.layers.2.bias",
            "trf_blocks.0.norm1.scale", "trf_blocks.1.norm2.shift", "final_norm.shift",
            "out_head.weight"} <= set(state)
    assert len(state) == 2 + 2 * (8 + 4 + 4) + 2 + 1
    np.testing.assert_array_equal(state["out_head.weight"], model.params["out_head.W"].T)
    np.testing.assert_array_equal(state["trf_blocks.0.ff.layers.0.weight"],
                                  model.params["trf_blocks.0.ff.layers.0.W"].T)
    with pytest.raises(ValueError, match="loads a qkvnp.GPTModel, got MultiHeadAttention"):
        to_torch(model.trf_blocks[0].att, "book.GPTModel")
    target = tiny_gpt(qkv_bias=True)
    before = {name: value.copy() for name, value in target.params.items()}
    broken = {k: v for k, v in state.items() if k != "final_norm.scale"}
    with pytest.raises(ValueError, match=r"missing \['final_norm.scale'\]"):
        from_torch(target, broken, "book.GPTModel")
    with pytest.raises(ValueError, match="biases the layer lacks"):
        from_torch(tiny_gpt(qkv_bias=False), state, "book.GPTModel")
    for name, value in target.params.items():  # a refused dict changed nothing
        np.testing.assert_array_equal(value, before[name])


def test_a_block_refuses_a_backward_before_forward_and_after_decode(rng):
    block = qkvnp.TransformerBlock(8, 2, rng=0)
    with pytest.raises(RuntimeError, match="before forward"):
        block.backward(rng.normal(size=(1, 3, 8)))
    x = rng.normal(size=(1, 3, 8))
    full = block.forward(x)
    decoded = block.decode(x, qkvnp.KVCache())  # oracle: the causal forward itself
    np.testing.assert_allclose(decoded, full, rtol=1e-12, atol=1e-12)
    before = {name: g.copy() for name, g in block.grads.items()}
    with pytest.raises(RuntimeError):
        block.backward(rng.normal(size=(1, 3, 8)))
    for name, grad in block.grads.items():  # refused before any gradient was added
        np.testing.assert_array_equal(grad, before[name])
