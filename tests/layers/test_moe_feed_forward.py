"""MoEFeedForward, the mixture-of-experts feed-forward, against its oracles.

Shape key: B batch, T tokens, N = B T, E embedding, F an expert's hidden
width, X experts, k experts a token.

Oracles: the complex step of every parameter and the input
(:func:`qkvnp.gradcheck.check_layer`, float64) at points whose top-k sets sit
at least 1e-3 from a change; PyTorch autograd of the same block written with
``softmax``, ``topk``, ``gather`` and ``nn.Linear(bias=False)`` experts
(float64, 1e-10); a dense loop running every expert on every token and
weighting it by its gate (0 off the chosen set); transformers'
``Qwen3MoeSparseMoeBlock`` when transformers is installed.
"""
import numpy as np
import pytest

from qkvnp import functional as F
from qkvnp.gradcheck import check_layer
from qkvnp.layers import MoEFeedForward

GATINGS = [
    ("softmax_topk", False),  # Qwen2-MoE, Qwen3-MoE's config default
    ("softmax_topk", True),  # Qwen3-MoE with norm_topk_prob
    ("topk_softmax", False),  # Mixtral
]
EXPERT_WEIGHTS = ("W_gate", "W_up", "W_down")


def silu(z):
    return z / (1.0 + np.exp(-z))


def dense_moe(layer, x):
    """Every expert on every token, weighted by its gate (0 where not chosen): the slow oracle."""
    x_rows = x.reshape(-1, layer.emb_dim)
    indices, gates, _ = F.router_forward(x_rows, layer.params["router.W"], layer.top_k,
                                         layer.gating, norm_topk_prob=layer.norm_topk_prob)
    out = np.zeros_like(x_rows)
    for i in range(layer.num_experts):
        W_gate, W_up, W_down = (layer.params[f"experts.{i}.{name}"] for name in EXPERT_WEIGHTS)
        y = (silu(x_rows @ W_gate) * (x_rows @ W_up)) @ W_down
        weight = np.sum(np.where(indices == i, gates, 0.0), axis=-1, keepdims=True)
        out += weight * y
    return out.reshape(x.shape)


@pytest.mark.parametrize("gating,norm", GATINGS)
def test_moe_gradients_pass_the_complex_step_certificate(gating, norm, rng):
    layer = MoEFeedForward(4, 6, num_experts=5, top_k=2, gating=gating, norm_topk_prob=norm, rng=1)
    x = rng.normal(size=(2, 5, 4))
    logits = x.reshape(-1, 4) @ layer.params["router.W"]
    scores = np.sort(F.softmax(logits, axis=-1) if gating == "softmax_topk" else logits, axis=-1)
    assert np.min(scores[:, -2] - scores[:, -3]) > 1e-3  # no top-2 set changes within the step
    report = check_layer(layer, x, method="complex_step")
    assert report.rows and report.ok, "\n" + report.table()


def test_moe_output_equals_every_expert_run_densely_and_gated(rng):
    layer = MoEFeedForward(5, 7, num_experts=6, top_k=2, rng=2)
    x = rng.normal(size=(3, 4, 5))
    out = layer.forward(x)
    assert out.shape == x.shape
    np.testing.assert_allclose(out, dense_moe(layer, x), rtol=0, atol=1e-14)


def torch_moe(torch, layer, x, drouter_logits=None):
    """The block in torch autograd: softmax, topk, gather, experts as Linear(bias=False)."""
    nn = torch.nn
    E, F_, X, k = layer.emb_dim, layer.hidden_dim, layer.num_experts, layer.top_k
    gate = nn.Linear(E, X, bias=False).double()
    experts = nn.ModuleList()
    with torch.no_grad():
        gate.weight.copy_(torch.tensor(layer.params["router.W"].T))
        for i in range(X):
            expert = nn.ModuleDict({name: nn.Linear(*shape, bias=False).double() for name, shape in
                                    (("gate_proj", (E, F_)), ("up_proj", (E, F_)), ("down_proj", (F_, E)))})
            for name, key in zip(("gate_proj", "up_proj", "down_proj"), EXPERT_WEIGHTS):
                expert[name].weight.copy_(torch.tensor(layer.params[f"experts.{i}.{key}"].T))
            experts.append(expert)
    xt = torch.tensor(x.reshape(-1, E), requires_grad=True)
    logits = gate(xt)
    if layer.gating == "softmax_topk":
        weights, selected = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        if layer.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        top, selected = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    out = torch.zeros_like(xt)
    for i, expert in enumerate(experts):
        token, slot = torch.where(selected == i)
        if token.numel():
            h = nn.functional.silu(expert["gate_proj"](xt[token])) * expert["up_proj"](xt[token])
            out = out.index_add(0, token, weights[token, slot, None] * expert["down_proj"](h))
    return xt, gate, experts, logits, out


@pytest.mark.parametrize("gating,norm", GATINGS)
@pytest.mark.parametrize("k", [1, 2, 8])  # k = X included
def test_moe_matches_torch_autograd(torch, gating, norm, k, rng):
    layer = MoEFeedForward(6, 10, num_experts=8, top_k=k, gating=gating, norm_topk_prob=norm, rng=3)
    x = rng.normal(size=(2, 9, 6))
    dout, drouter_logits = rng.normal(size=x.shape), rng.normal(size=(18, 8))
    out, logits = layer.forward(x, return_router_logits=True)
    dx = layer.backward(dout, drouter_logits=drouter_logits)
    xt, gate, experts, logits_t, out_t = torch_moe(torch, layer, x)
    ((out_t * torch.tensor(dout.reshape(-1, 6))).sum()
     + (logits_t * torch.tensor(drouter_logits)).sum()).backward()
    assert out.shape == dx.shape == x.shape and logits.shape == (18, 8)
    np.testing.assert_allclose(out.reshape(-1, 6), out_t.detach().numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(logits, logits_t.detach().numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(dx.reshape(-1, 6), xt.grad.numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(layer.grads["router.W"], gate.weight.grad.numpy().T, rtol=0, atol=1e-10)
    for i, expert in enumerate(experts):
        for name, key in zip(("gate_proj", "up_proj", "down_proj"), EXPERT_WEIGHTS):
            torch_grad = expert[name].weight.grad
            expected = np.zeros_like(layer.grads[f"experts.{i}.{key}"]) if torch_grad is None \
                else torch_grad.numpy().T
            np.testing.assert_allclose(layer.grads[f"experts.{i}.{key}"], expected, rtol=0,
                                       atol=1e-10, err_msg=f"experts.{i}.{key}")


def test_the_load_balancing_loss_reaches_the_router_through_drouter_logits(torch, rng):
    # total loss <dout, out> + coef * aux(logits): torch autograd of the same sum
    layer = MoEFeedForward(4, 5, num_experts=4, top_k=2, rng=4)
    x, dout, coef = rng.normal(size=(10, 4)), rng.normal(size=(10, 4)), 0.01
    out, logits = layer.forward(x, return_router_logits=True)
    aux, aux_cache = F.load_balancing_loss_forward(logits, 2)
    layer.backward(dout, drouter_logits=F.load_balancing_loss_backward(coef, aux_cache))
    xt, gate, _, logits_t, out_t = torch_moe(torch, layer, x)
    probs = torch.softmax(logits_t, dim=-1)
    mask = torch.nn.functional.one_hot(torch.topk(probs, 2, dim=-1).indices, 4).double()
    aux_t = 4 * torch.sum(mask.mean(dim=0) * probs.mean(dim=0).unsqueeze(0))
    ((out_t * torch.tensor(dout)).sum() + coef * aux_t).backward()
    np.testing.assert_allclose(aux, aux_t.item(), rtol=1e-13)
    np.testing.assert_allclose(layer.grads["router.W"], gate.weight.grad.numpy().T, rtol=0, atol=1e-10)


def starved_layer():
    """X = 4, k = 2; expert 3's logit is -50 for every token whose first feature is 5."""
    layer = MoEFeedForward(4, 6, num_experts=4, top_k=2, rng=5)
    layer.params["router.W"][:, 3] = [-10.0, 0.0, 0.0, 0.0]
    return layer


def test_an_expert_that_receives_no_token_gets_zero_gradients_and_does_not_run(rng):
    layer = starved_layer()
    x = rng.normal(size=(3, 4))
    x[:, 0] = 5.0
    out = layer.forward(x)
    assert layer._cache.routed[3] is None  # it did not run
    np.testing.assert_allclose(out, dense_moe(layer, x), rtol=0, atol=1e-14)
    dx = layer.backward(rng.normal(size=x.shape))
    assert dx.shape == x.shape
    for name in EXPERT_WEIGHTS:
        assert not layer.grads[f"experts.3.{name}"].any(), name
    assert layer.grads["experts.0.W_gate"].any() or layer.grads["experts.1.W_gate"].any()


def test_an_expert_that_receives_no_token_passes_the_complex_step_certificate(rng):
    x = rng.normal(size=(3, 4))
    x[:, 0] = 5.0
    report = check_layer(starved_layer(), x, method="complex_step")
    assert report.rows and report.ok, "\n" + report.table()


def test_an_unchosen_experts_weights_do_not_change_the_output(rng):
    # only the chosen experts run: the starved expert's weights may be anything finite
    layer = starved_layer()
    x = rng.normal(size=(3, 4))
    x[:, 0] = 5.0
    before = layer.forward(x)
    layer.params["experts.3.W_down"][:] = 1e300
    np.testing.assert_array_equal(layer.forward(x), before)


def test_moe_refuses_bad_counts_and_options_by_name():
    with pytest.raises(ValueError, match=r"top_k must be in \[1, num_experts=4\], got 5"):
        MoEFeedForward(4, 8, num_experts=4, top_k=5)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, num_experts=4\], got 0"):
        MoEFeedForward(4, 8, num_experts=4, top_k=0)
    with pytest.raises(ValueError, match="num_experts must be >= 1, got 0"):
        MoEFeedForward(4, 8, num_experts=0, top_k=1)
    with pytest.raises(TypeError, match="num_experts must be an int, got float"):
        MoEFeedForward(4, 8, num_experts=4.0, top_k=1)
    with pytest.raises(ValueError, match="gating must be one of"):
        MoEFeedForward(4, 8, 4, 2, gating="softmax")
    with pytest.raises(ValueError, match="activation must be one of"):
        MoEFeedForward(4, 8, 4, 2, activation="gelu")
    layer = MoEFeedForward(4, 8, 4, 2, rng=0)
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., 4\), got shape \(2, 3\)"):
        layer.forward(np.ones((2, 3)))
    layer.forward(np.ones((2, 4)))
    with pytest.raises(ValueError, match=r"drouter_logits must have shape \(2, 4\)"):
        layer.backward(np.ones((2, 4)), drouter_logits=np.ones((2, 3)))


def hf_qwen3_moe_weights(layer, names, arrays):
    """The layer's ``arrays`` (params or grads) under the transformers block's ``names``.

    Per-expert layout (``experts.i.gate_proj.weight``, each ``W.T``) or the
    fused one (``experts.gate_up_proj (X, 2F, E)``, ``experts.down_proj (X, E, F)``).
    """
    X = layer.num_experts
    state = {}
    for name in names:
        if name == "gate.weight":
            continue
        if name.startswith("experts.") and name.count(".") == 3:  # experts.i.gate_proj.weight
            _, i, proj, _ = name.split(".")
            key = {"gate_proj": "W_gate", "up_proj": "W_up", "down_proj": "W_down"}[proj]
            state[name] = arrays[f"experts.{i}.{key}"].T
        elif name == "experts.gate_up_proj":
            state[name] = np.stack([np.concatenate([arrays[f"experts.{i}.W_gate"].T,
                                                    arrays[f"experts.{i}.W_up"].T]) for i in range(X)])
        elif name == "experts.down_proj":
            state[name] = np.stack([arrays[f"experts.{i}.W_down"].T for i in range(X)])
        else:
            pytest.skip(f"this transformers' Qwen3MoeSparseMoeBlock has a parameter {name!r} "
                        "the test does not map")
    return state


def hf_qwen3_moe_block(transformers, torch, layer):
    """transformers' Qwen3MoeSparseMoeBlock holding the layer's weights."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe

    config = transformers.Qwen3MoeConfig(
        hidden_size=layer.emb_dim, moe_intermediate_size=layer.hidden_dim,
        num_experts=layer.num_experts, num_experts_per_tok=layer.top_k,
        norm_topk_prob=layer.norm_topk_prob, hidden_act="silu")
    block = qwen3_moe.Qwen3MoeSparseMoeBlock(config).double().eval()
    state = hf_qwen3_moe_weights(layer, block.state_dict(), layer.params)
    state["gate.weight"] = layer.params["router.W"].T
    block.load_state_dict({name: torch.tensor(value) for name, value in state.items()})
    return block


@pytest.mark.parametrize("norm", [False, True])
def test_moe_matches_transformers_qwen3_moe_block(torch, norm, rng, monkeypatch):
    transformers = pytest.importorskip("transformers")
    # NOTE: Qwen3MoeTopKRouter computes its softmax with dtype=torch.float whatever the
    # model's dtype: patched here alone to keep float64 input in float64
    softmax = torch.nn.functional.softmax

    def softmax_in_input_dtype(input, *args, dtype=None, **kwargs):
        return softmax(input, *args, dtype=None if input.dtype == torch.float64 else dtype,
                       **kwargs)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax_in_input_dtype)
    layer = MoEFeedForward(8, 12, num_experts=6, top_k=2, norm_topk_prob=norm, rng=6)
    x, dout = rng.normal(size=(2, 5, 8)), rng.normal(size=(2, 5, 8))
    out = layer.forward(x)
    dx = layer.backward(dout)
    block = hf_qwen3_moe_block(transformers, torch, layer)
    xt = torch.tensor(x, requires_grad=True)
    out_t = block(xt)
    out_t = out_t[0] if isinstance(out_t, tuple) else out_t
    (out_t * torch.tensor(dout)).sum().backward()
    np.testing.assert_allclose(out, out_t.detach().numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=0, atol=1e-10)
    hf_grads = {name: p.grad.numpy() for name, p in block.named_parameters()}
    np.testing.assert_allclose(layer.grads["router.W"], hf_grads["gate.weight"].T, rtol=0,
                               atol=1e-10)
    expected = hf_qwen3_moe_weights(layer, hf_grads, layer.grads)
    for name, grad in expected.items():
        np.testing.assert_allclose(grad, hf_grads[name], rtol=0, atol=1e-10, err_msg=name)
