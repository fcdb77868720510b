"""GPT-2 = the book's GPT with qkv_bias=True and the tied head, against torch's book GPT
with ``out_head.weight = tok_emb.weight`` (autograd is the oracle), float64."""
import numpy as np
import pytest

import qkvnp
from qkvnp.interop import from_torch, to_torch
from qkvnp.losses import cross_entropy_backward, cross_entropy_forward
from qkvnp.optim import AdamW

from test_gpt_torch import CFG, book_gpt, relative

GPT2 = {**CFG, "qkv_bias": True}


def tied_pair(torch):
    model = qkvnp.GPTModel.from_config(GPT2, rng=0, tie_embeddings=True)
    oracle = book_gpt(torch)(GPT2).double()
    oracle.out_head.weight = oracle.tok_emb.weight
    from_torch(model, oracle.state_dict(), "book.GPTModel")
    return model, oracle


def test_logits_every_gradient_and_an_adamw_step_match_torchs_tied_gpt(torch):
    model, oracle = tied_pair(torch)
    assert "out_head.W" not in model.params  # one parameter
    rng = np.random.default_rng(3)
    idx, targets = rng.integers(0, 13, size=(3, 7)), rng.integers(0, 13, size=(3, 7))
    logits = model.forward(idx)
    loss, cache = cross_entropy_forward(logits, targets)
    model.backward(cross_entropy_backward(1.0, cache))
    torch_logits = oracle(torch.from_numpy(idx))
    torch.nn.functional.cross_entropy(torch_logits.flatten(0, 1),
                                      torch.from_numpy(targets).flatten()).backward()
    assert relative(logits, torch_logits.detach().numpy()) <= 1e-10
    torch_grads = {n: p.grad.numpy() for n, p in oracle.named_parameters()}  # tied: once
    assert "out_head.weight" not in torch_grads
    holder = qkvnp.GPTModel.from_config(GPT2, rng=0, tie_embeddings=True)
    from_torch(holder, {**torch_grads, "out_head.weight": torch_grads["tok_emb.weight"]},
               "book.GPTModel")
    for name, grad in model.grads.items():
        if not name.endswith(".b_key"):
            assert relative(grad, holder.params[name]) <= 1e-10, name
    AdamW(model.params, lr=1e-2, weight_decay=0.1).step(model.grads)
    torch.optim.AdamW(oracle.parameters(), lr=1e-2, weight_decay=0.1).step()
    ours = to_torch(model, "book.GPTModel")
    np.testing.assert_array_equal(ours["out_head.weight"], ours["tok_emb.weight"])
    assert relative(ours["tok_emb.weight"], oracle.tok_emb.weight.detach().numpy()) <= 1e-10


def test_state_dict_gives_both_names_and_load_refuses_a_differing_pair(torch):
    model = qkvnp.GPTModel(11, 8, 8, 2, 1, rng=0, tie_embeddings=True)
    state = model.state_dict()
    np.testing.assert_array_equal(state["out_head.W"], state["tok_emb.weight"].T)
    model.load_state_dict(state)
    head_only = {k: v for k, v in state.items() if k != "tok_emb.weight"}
    head_only["out_head.W"] = head_only["out_head.W"] + 1.0
    model.load_state_dict(head_only)
    np.testing.assert_array_equal(model.params["tok_emb.weight"], head_only["out_head.W"].T)
    bad = model.state_dict()
    bad["out_head.W"] = bad["out_head.W"] * 2
    with pytest.raises(ValueError, match=r"state_dict\['tok_emb.weight'\] and state_dict\['out_head.W'\] differ"):
        model.load_state_dict(bad)
    untied = book_gpt(torch)(GPT2).double()
    tied = qkvnp.GPTModel.from_config(GPT2, rng=0, tie_embeddings=True)
    with pytest.raises(ValueError, match=r"state_dict\['out_head.weight'\] differs"):
        from_torch(tied, untied.state_dict(), "book.GPTModel")


def test_generate_and_decode_run_tied():
    model = qkvnp.GPTModel(11, 8, 8, 2, 2, rng=0, tie_embeddings=True)
    idx = np.array([[1, 2, 3]])
    full = model.forward(idx)
    decoded = model.decode(idx, [qkvnp.KVCache() for _ in range(2)])
    np.testing.assert_allclose(decoded, full, rtol=0, atol=1e-12)
    assert qkvnp.generate(model, idx, 3).shape == (1, 6)
