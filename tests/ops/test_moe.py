"""The mixture of experts' router, its gates and its load-balancing loss against their oracles.

Shape key: N tokens, E embedding, X experts, k experts a token.

Oracles: the complex step of ``<dgates, gates(x, W)>`` with a random
``dgates`` (:mod:`qkvnp.gradcheck`, float64), at points whose top-k sets sit
at least 1e-3 from a change; PyTorch autograd of the same formula written
with ``softmax``, ``topk`` and ``gather`` (float64, 1e-10), and
``torch.topk`` itself for the order of tied values; closed forms (k = X
keeps every probability; a balanced router's loss is k).
"""
import numpy as np
import pytest

from qkvnp import functional as F
from qkvnp.gradcheck import check_op
from qkvnp.ops.topk import topk_indices

GATINGS = [
    ("softmax_topk", False),  # Qwen2-MoE, Qwen3-MoE's config default
    ("softmax_topk", True),  # Qwen3-MoE with norm_topk_prob
    ("topk_softmax", False),  # Mixtral, gpt-oss
]


def assert_ok(report):
    assert report.rows, "nothing was checked"
    assert report.ok, "\n" + report.table()


def gates_forward(x, W_router, k, gating, norm_topk_prob):
    """The router as ``(gates, cache)``: the pair the checker differentiates."""
    _, gates, cache = F.router_forward(x, W_router, k, gating, norm_topk_prob=norm_topk_prob)
    return gates, cache


gates_forward.supports_complex_step = True


def routing_margin(x, W_router, k, gating):
    """The smallest gap, over tokens, between the k-th and (k+1)-th selection score."""
    logits = x.reshape(-1, x.shape[-1]) @ W_router
    scores = F.softmax(logits, axis=-1) if gating == "softmax_topk" else logits
    ranked = -np.sort(-scores, axis=-1)
    return np.inf if k == scores.shape[1] else float(np.min(ranked[:, k - 1] - ranked[:, k]))


@pytest.mark.parametrize("gating,norm", GATINGS)
@pytest.mark.parametrize("k", [1, 2, 5])  # one expert; Mixtral's two; k = X
def test_router_gradients_pass_the_complex_step_certificate(gating, norm, k, rng):
    x, W_router = rng.normal(size=(3, 4, 6)), rng.normal(size=(6, 5))
    assert routing_margin(x, W_router, k, gating) > 1e-3  # no top-k set changes within the step
    report = check_op(gates_forward, F.router_backward, {"x": x, "W_router": W_router},
                      forward_kwargs={"k": k, "gating": gating, "norm_topk_prob": norm},
                      method="complex_step")
    assert_ok(report)


def torch_router(torch, x, W_router, k, gating, norm):
    """The families' gates in torch: softmax, topk and gather, as Hugging Face's blocks."""
    logits = x @ W_router
    if gating == "softmax_topk":
        probs = torch.softmax(logits, dim=-1)
        gates, indices = torch.topk(probs, k, dim=-1)
        if norm:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return indices, gates
    selected, indices = torch.topk(logits, k, dim=-1)
    return indices, torch.softmax(selected, dim=-1)


@pytest.mark.parametrize("gating,norm", GATINGS)
@pytest.mark.parametrize("k", [1, 2, 8])
def test_router_matches_torch_autograd(torch, gating, norm, k, rng):
    x, W_router = rng.normal(size=(20, 6)), rng.normal(size=(6, 8))
    dgates = rng.normal(size=(20, k))
    indices, gates, cache = F.router_forward(x, W_router, k, gating, norm_topk_prob=norm)
    dx, dW_router = F.router_backward(dgates, cache)
    xt = torch.tensor(x, requires_grad=True)
    Wt = torch.tensor(W_router, requires_grad=True)
    indices_t, gates_t = torch_router(torch, xt, Wt, k, gating, norm)
    (gates_t * torch.tensor(dgates)).sum().backward()
    assert indices.shape == gates.shape == (20, k) and dx.shape == x.shape
    np.testing.assert_array_equal(indices, indices_t.numpy())
    np.testing.assert_allclose(gates, gates_t.detach().numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(dW_router, Wt.grad.numpy(), rtol=0, atol=1e-10)


def test_norm_topk_prob_equals_topk_softmax_away_from_ties(rng):
    # softmax(s)_I / sum softmax(s)_I = exp(s_I) / sum exp(s_I) = softmax(s_I)
    x, W_router = rng.normal(size=(7, 4)), rng.normal(size=(4, 6))
    i1, g1, _ = F.router_forward(x, W_router, 3, "softmax_topk", norm_topk_prob=True)
    i2, g2, _ = F.router_forward(x, W_router, 3, "topk_softmax")
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_allclose(g1, g2, rtol=1e-14)


def test_k_equal_to_the_number_of_experts_keeps_every_probability(rng):
    # k = X: the chosen set is every expert, so the gates are the sorted softmax
    x, W_router = rng.normal(size=(5, 3)), rng.normal(size=(3, 4))
    indices, gates, _ = F.router_forward(x, W_router, 4)
    assert gates.shape == (5, 4)
    np.testing.assert_array_equal(np.sort(indices, axis=-1), np.tile(np.arange(4), (5, 1)))
    probs = F.softmax(x @ W_router, axis=-1)
    np.testing.assert_allclose(gates, -np.sort(-probs, axis=-1), rtol=1e-15)
    np.testing.assert_allclose(gates.sum(axis=-1), 1.0, rtol=1e-14)


def test_ties_between_expert_logits_are_resolved_as_torch_topk_does(torch):
    # torch.topk on CPU is no stable sort: [1, 2, 2, 0, 2, 1] gives [2] at k = 1,
    # [2, 4] at k = 2 and [2, 4, 1] at k = 3 (libstdc++'s nth_element, then sort)
    row = np.array([[1.0, 2.0, 2.0, 0.0, 2.0, 1.0]])
    for k, expected in [(1, [2]), (2, [2, 4]), (3, [2, 4, 1]), (6, [1, 2, 4, 5, 0, 3])]:
        np.testing.assert_array_equal(topk_indices(row, k), [expected])
        np.testing.assert_array_equal(torch.topk(torch.tensor(row), k).indices.numpy(), [expected])


@pytest.mark.parametrize("X", [2, 5, 17, 40, 64, 130])  # small; > 16 (std::sort splits); 64 k <= X
def test_tied_rows_choose_the_experts_torch_topk_chooses(torch, X):
    rng = np.random.default_rng(X)
    for _ in range(40):
        k = int(rng.integers(1, X + 1)) if rng.random() < 0.5 else int(rng.integers(1, min(X, 3) + 1))
        values = rng.integers(0, int(rng.integers(1, 4)), size=(6, X)).astype(float)  # many ties
        expected = torch.topk(torch.tensor(values), k).indices.numpy()
        np.testing.assert_array_equal(topk_indices(values, k), expected,
                                      err_msg=f"X={X} k={k}\n{values}")


@pytest.mark.parametrize("gating,norm", GATINGS)
def test_a_router_with_tied_logits_routes_as_torch(torch, gating, norm, rng):
    # a zero router: every logit 0, every probability 1/X, the ties only torch.topk's order breaks
    x, W_router = rng.normal(size=(4, 3)), np.zeros((3, 6))
    indices, gates, _ = F.router_forward(x, W_router, 2, gating, norm_topk_prob=norm)
    indices_t, gates_t = torch_router(torch, torch.tensor(x), torch.tensor(W_router), 2, gating, norm)
    np.testing.assert_array_equal(indices, indices_t.numpy())
    np.testing.assert_allclose(gates, gates_t.numpy(), rtol=1e-15)


def test_router_refuses_bad_k_and_expert_counts_by_name(rng):
    x = rng.normal(size=(2, 3))
    with pytest.raises(ValueError, match=r"k must be in \[1, num_experts=4\], got 5"):
        F.router_forward(x, rng.normal(size=(3, 4)), 5)
    with pytest.raises(ValueError, match=r"k must be in \[1, num_experts=4\], got 0"):
        F.router_forward(x, rng.normal(size=(3, 4)), 0)
    with pytest.raises(TypeError, match="k must be an int, got bool"):
        F.router_forward(x, rng.normal(size=(3, 4)), True)
    with pytest.raises(ValueError, match="num_experts must be >= 1, got 0"):
        F.router_forward(x, np.zeros((3, 0)), 1)
    with pytest.raises(ValueError, match="gating must be one of"):
        F.router_forward(x, rng.normal(size=(3, 4)), 1, "sigmoid")
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., 2\)"):
        F.router_forward(x, rng.normal(size=(2, 4)), 1)
    with pytest.raises(ValueError, match=r"dgates must have shape \(2, 1\)"):
        _, _, cache = F.router_forward(x, rng.normal(size=(3, 4)), 1)
        F.router_backward(np.ones((2, 2)), cache)


# ------------------------------------------------------------------ load balancing


def test_load_balancing_loss_passes_the_complex_step_certificate(rng):
    logits = rng.normal(size=(12, 5))
    report = check_op(F.load_balancing_loss_forward, F.load_balancing_loss_backward,
                      {"router_logits": logits}, forward_kwargs={"k": 2}, method="complex_step")
    assert_ok(report)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_load_balancing_loss_matches_transformers_formula_under_torch_autograd(torch, k, rng):
    # transformers' load_balancing_loss_func without attention_mask, written out
    logits, coef = rng.normal(size=(30, 4)), 0.37
    loss, cache = F.load_balancing_loss_forward(logits, k)
    dlogits = F.load_balancing_loss_backward(coef, cache)
    lt = torch.tensor(logits, requires_grad=True)
    routing_weights = torch.softmax(lt, dim=-1)
    _, selected = torch.topk(routing_weights, k, dim=-1)
    expert_mask = torch.nn.functional.one_hot(selected, 4)
    tokens_per_expert = torch.mean(expert_mask.double(), dim=0)
    router_prob_per_expert = torch.mean(routing_weights, dim=0)
    loss_t = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * 4
    (coef * loss_t).backward()
    assert loss.shape == () and dlogits.shape == logits.shape
    np.testing.assert_allclose(loss, loss_t.item(), rtol=1e-13)
    np.testing.assert_allclose(dlogits, lt.grad.numpy(), rtol=0, atol=1e-12)


def test_a_balanced_router_has_loss_k():
    # equal probabilities 1/X: X * sum_i f_i / X = sum_i f_i = k
    loss, _ = F.load_balancing_loss_forward(np.zeros((8, 4)), 3)
    assert float(loss) == pytest.approx(3.0, rel=1e-15)


@pytest.mark.parametrize("layers", [1, 3])  # transformers sums every layer's counts and probabilities
def test_load_balancing_loss_matches_transformers_own_function(torch, layers, rng):
    # NOTE: transformers accumulates the loss in float32 whatever the dtype: compared to 1e-6
    qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    per_layer = [rng.normal(size=(10, 6)) for _ in range(layers)]
    coef = 0.3
    loss, cache = F.load_balancing_loss_forward(np.concatenate(per_layer), 2)
    dlogits = F.load_balancing_loss_backward(coef, cache)
    tensors = tuple(torch.tensor(logits, requires_grad=True) for logits in per_layer)
    loss_t = qwen3_moe.load_balancing_loss_func(tensors, num_experts=6, top_k=2)
    (coef * loss_t).backward()
    np.testing.assert_allclose(loss, loss_t.item(), rtol=1e-6)
    expected = np.concatenate([t.grad.numpy() for t in tensors])
    np.testing.assert_allclose(dlogits, expected, rtol=0, atol=1e-7)
