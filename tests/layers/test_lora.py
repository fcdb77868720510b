"""LoRALinear, apply_lora and merge_lora.

Oracles: torch autograd of the same formula ``x W + b + s (x A) B`` (float64,
random upstream gradients); the complex step of qkvnp.gradcheck; the merged
Linear (a plain ``x (W + s A B) + b``); bit equality where nothing may change.
"""
import numpy as np
import pytest

import qkvnp
from qkvnp.gradcheck import check_layer
from qkvnp.layers import Linear, LoRALinear, apply_lora, merge_lora
from qkvnp.losses import cross_entropy_backward, cross_entropy_forward
from qkvnp.optim import AdamW


def adapted(seed=0, bias=True):
    lora = LoRALinear(Linear(5, 4, bias, rng=seed), 3, alpha=6.0, rng=seed + 1)
    lora.params["B"][...] = np.random.default_rng(seed + 2).normal(size=(3, 4))  # off zero
    return lora


@pytest.mark.parametrize("bias", [True, False])
def test_adapter_gradients_match_torch_autograd(torch, bias):
    lora = adapted(bias=bias)
    rng = np.random.default_rng(7)
    x, dout = rng.normal(size=(2, 6, 5)), rng.normal(size=(2, 6, 4))
    out = lora.forward(x)
    dx = lora.backward(dout)
    t = {k: torch.tensor(v, requires_grad=True) for k, v in
         {"x": x, "A": lora.params["A"], "B": lora.params["B"]}.items()}
    W = torch.tensor(lora.base.params["W"])
    y = t["x"] @ W + 2.0 * (t["x"] @ t["A"]) @ t["B"]
    if bias:
        y = y + torch.tensor(lora.base.params["b"])
    y.backward(torch.tensor(dout))
    assert out.shape == (2, 6, 4) and dx.shape == x.shape
    np.testing.assert_allclose(out, y.detach().numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(dx, t["x"].grad.numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(lora.grads["A"], t["A"].grad.numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(lora.grads["B"], t["B"].grad.numpy(), rtol=0, atol=1e-10)
    assert sorted(lora.params) == ["A", "B"]  # no W, b: frozen
    assert not lora.base.grads["W"].any()


def test_complex_step_certifies_the_adapters():
    report = check_layer(adapted(), np.random.default_rng(3).normal(size=(3, 5)),
                         method="complex_step")
    assert report.rows and report.ok, "\n" + report.table()


def test_an_adapted_model_is_unchanged_at_init_and_equals_its_merge():
    model = qkvnp.GPTModel(11, 8, 8, 2, 2, rng=0)
    idx = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    before = model.forward(idx)
    names = apply_lora(model, ["ff.layers.0", "out_head"], 2, alpha=4.0, rng=1)
    assert names == ["trf_blocks.0.ff.layers.0", "trf_blocks.1.ff.layers.0", "out_head"]
    np.testing.assert_array_equal(model.forward(idx), before)  # B = 0: bit for bit
    rng = np.random.default_rng(2)
    for name, value in model.params.items():
        if name.endswith(".B"):
            value[...] = rng.normal(size=value.shape)
    after = model.forward(idx)
    assert np.abs(after - before).max() > 1e-3
    decoded = model.decode(idx, [qkvnp.KVCache() for _ in range(2)])
    np.testing.assert_allclose(decoded, after, rtol=0, atol=1e-12)
    assert merge_lora(model) == names
    assert isinstance(model.out_head, Linear)
    np.testing.assert_allclose(model.forward(idx), after, rtol=0, atol=1e-12)


def test_an_optimizer_steps_only_the_adapters():
    model = qkvnp.GPTModel(11, 8, 8, 2, 1, rng=0)
    apply_lora(model, ["out_head", "layers.2"], 2, rng=1)
    frozen = {name: layer.base.params["W"].copy() for name, layer in model.named_layers()
              if isinstance(layer, LoRALinear)}
    trainable = [name for name in model.params if name.endswith((".A", ".B"))]
    model.params  # the adapters are in params; the frozen W are not
    assert "out_head.W" not in model.params and "out_head.A" in model.params
    optimizer = AdamW({name: model.params[name] for name in trainable}, lr=1e-2)
    idx, targets = np.array([[1, 2, 3]]), np.array([[2, 3, 4]])
    start = {name: model.params[name].copy() for name in trainable}
    loss, cache = cross_entropy_forward(model.forward(idx), targets)
    model.backward(cross_entropy_backward(1.0, cache))
    optimizer.step({name: model.grads[name] for name in trainable})
    assert all(not np.array_equal(model.params[n], start[n]) for n in trainable if n.endswith(".B"))
    for name, layer in model.named_layers():
        if isinstance(layer, LoRALinear):
            np.testing.assert_array_equal(layer.base.params["W"], frozen[name])


def test_targets_that_match_nothing_are_refused_by_name():
    model = qkvnp.GPTModel(11, 8, 8, 2, 1, rng=0)
    with pytest.raises(ValueError, match=r"\['q_proj'\] name no Linear"):
        apply_lora(model, ["out_head", "q_proj"], 2)
    assert isinstance(model.out_head, Linear)  # refused before any change
    with pytest.raises(ValueError, match="rank"):
        LoRALinear(Linear(3, 2, rng=0), 0)


def test_adapter_params_are_the_adapters_alone_and_train_only_them():
    """Oracle: the frozen and the non-adapted arrays bit-identical after AdamW on adapter_params."""
    from qkvnp.layers import adapter_grads, adapter_params
    from qkvnp.optim import AdamW

    model = qkvnp.GPTModel(16, 8, 8, 2, 1, rng=0)
    with pytest.raises(ValueError, match="no LoRALinear"):
        adapter_params(model)
    apply_lora(model, ["out_head", "ff.layers.0"], rank=2, rng=1)
    params = adapter_params(model)
    assert sorted(params) == ["out_head.A", "out_head.B", "trf_blocks.0.ff.layers.0.A",
                              "trf_blocks.0.ff.layers.0.B"]
    assert all(params[name] is model.params[name] for name in params)
    before = {name: value.copy() for name, value in model.params.items()}
    optimizer = AdamW(params, lr=1e-2)
    idx = np.array([[1, 2, 3, 4]])
    model.forward(idx)
    model.backward(np.random.default_rng(2).standard_normal((1, 4, 16)))
    grads = adapter_grads(model)
    assert sorted(grads) == sorted(params)
    optimizer.step(grads)
    changed = {name for name, value in model.params.items() if not np.array_equal(value, before[name])}
    assert changed == set(params)  # the adapters alone (A by AdamW's weight decay)


def test_an_adapted_gpt_is_refused_by_to_torch_naming_merge_lora():
    from qkvnp.interop import to_torch

    model = qkvnp.GPTModel(16, 8, 8, 2, 1, rng=0)
    apply_lora(model, ["out_head"], rank=2, rng=1)
    with pytest.raises(ValueError, match="merge_lora"):
        to_torch(model, "book.GPTModel")
