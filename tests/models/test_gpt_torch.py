"""GPTModel against the book's GPT rebuilt in PyTorch (autograd is the oracle).

Shape key: B batch, T tokens, E embedding, V vocabulary, H heads.

The oracle is written here from the book's chapter 4 (rasbt/LLMs-from-scratch,
``ch04/01_main-chapter-code/gpt.py``): ``tok_emb``/``pos_emb`` embeddings and
``drop_emb``; blocks of ``x + drop(att(norm1(x)))`` then ``x + drop(ff(norm2(x)))``
with the chapter-3 causal ``MultiHeadAttention`` (``W_query``/``W_key``/
``W_value`` linears, ``1/sqrt(head_dim)``, dropout on the weights,
``out_proj``); the book's ``LayerNorm`` (biased variance, eps 1e-5, ``scale``/
``shift``) and tanh ``GELU``; ``final_norm``; ``out_head`` without bias. Its
dropouts replay given masks (``x * mask * (1 / (1 - p))``, torch's own
scaling), so that a run with dropout is comparable. float64 throughout;
every tolerance is relative to the tensor's largest entry.
"""
import numpy as np
import pytest

import qkvnp
from qkvnp.interop import from_torch, to_torch
from qkvnp.losses import cross_entropy_backward, cross_entropy_forward
from qkvnp.optim import AdamW

CFG = {"vocab_size": 13, "context_length": 8, "emb_dim": 12, "n_heads": 3, "n_layers": 2,
       "drop_rate": 0.0, "qkv_bias": False}


def book_gpt(torch):
    """The book's ``GPTModel`` (chapter 4) with replayable dropout masks."""
    nn = torch.nn

    def drop(x, p, mask, training):
        if mask is not None:
            return x * (torch.as_tensor(mask, dtype=x.dtype) * (1.0 / (1.0 - p)))
        return nn.functional.dropout(x, p, training)

    class MultiHeadAttention(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            E, n = cfg["emb_dim"], cfg["context_length"]
            self.num_heads, self.head_dim = cfg["n_heads"], E // cfg["n_heads"]
            self.p = cfg["drop_rate"]
            self.W_query = nn.Linear(E, E, bias=cfg["qkv_bias"])
            self.W_key = nn.Linear(E, E, bias=cfg["qkv_bias"])
            self.W_value = nn.Linear(E, E, bias=cfg["qkv_bias"])
            self.out_proj = nn.Linear(E, E)
            self.register_buffer("mask", torch.triu(torch.ones(n, n), diagonal=1))

        def forward(self, x, mask=None):
            b, T, E = x.shape
            def split(y):
                return y.view(b, T, self.num_heads, self.head_dim).transpose(1, 2)

            q, k, v = split(self.W_query(x)), split(self.W_key(x)), split(self.W_value(x))
            scores = q @ k.transpose(2, 3)
            scores = scores.masked_fill(self.mask.bool()[:T, :T], -torch.inf)
            weights = torch.softmax(scores / k.shape[-1] ** 0.5, dim=-1)
            weights = drop(weights, self.p, mask, self.training)
            context = (weights @ v).transpose(1, 2).contiguous().view(b, T, E)
            return self.out_proj(context)

    class LayerNorm(nn.Module):
        def __init__(self, E):
            super().__init__()
            self.eps = 1e-5
            self.scale = nn.Parameter(torch.ones(E))
            self.shift = nn.Parameter(torch.zeros(E))

        def forward(self, x):
            mean = x.mean(dim=-1, keepdim=True)
            var = x.var(dim=-1, keepdim=True, unbiased=False)
            return self.scale * (x - mean) / torch.sqrt(var + self.eps) + self.shift

    class GELU(nn.Module):
        def forward(self, x):
            c = torch.sqrt(torch.tensor(2.0 / torch.pi, dtype=x.dtype))
            return 0.5 * x * (1 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3))))

    class FeedForward(nn.Module):
        def __init__(self, E):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(E, 4 * E), GELU(), nn.Linear(4 * E, E))

        def forward(self, x):
            return self.layers(x)

    class TransformerBlock(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.att, self.ff = MultiHeadAttention(cfg), FeedForward(cfg["emb_dim"])
            self.norm1, self.norm2 = LayerNorm(cfg["emb_dim"]), LayerNorm(cfg["emb_dim"])
            self.p = cfg["drop_rate"]

        def forward(self, x, masks):
            h = self.att(self.norm1(x), masks.get("att"))
            x = x + drop(h, self.p, masks.get("drop_shortcut1"), self.training)
            h = self.ff(self.norm2(x))
            return x + drop(h, self.p, masks.get("drop_shortcut2"), self.training)

    class GPTModel(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
            self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
            self.trf_blocks = nn.Sequential(
                *[TransformerBlock(cfg) for _ in range(cfg["n_layers"])])
            self.final_norm = LayerNorm(cfg["emb_dim"])
            self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)
            self.p = cfg["drop_rate"]

        def forward(self, idx, masks=None):
            masks = masks or {}
            T = idx.shape[1]
            x = self.tok_emb(idx) + self.pos_emb(torch.arange(T))
            x = drop(x, self.p, masks.get("drop_emb"), self.training)
            for i, block in enumerate(self.trf_blocks):
                prefix = f"trf_blocks.{i}."
                x = block(x, {k[len(prefix):]: v for k, v in masks.items() if k.startswith(prefix)})
            return self.out_head(self.final_norm(x))

    return GPTModel


def relative(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def assert_gradients_match(grads, expected, rtol):
    """Every gradient to ``rtol``; ``b_key``'s, 0 in exact arithmetic, to round-off on both sides.

    NOTE: ``b_key`` adds ``q . b_key`` to every score of a query's row, which
    softmax ignores: both libraries compute it as a cancelling sum (~1e-18),
    whose digits are noise. It is checked against ``b_query``'s scale instead.
    """
    assert set(expected) == set(grads)
    for name, grad in grads.items():
        if name.endswith(".b_key"):
            scale = np.abs(grads[name.replace(".b_key", ".b_query")]).max()
            assert max(np.abs(grad).max(), np.abs(expected[name]).max()) <= 1e-12 * scale, name
        else:
            assert relative(grad, expected[name]) <= rtol, name


def pair(torch, cfg, seed=0):
    """A qkvnp GPTModel and the torch oracle holding the same float64 weights."""
    model = qkvnp.GPTModel.from_config(cfg, rng=seed)
    rng = np.random.default_rng(seed + 1)
    for name, value in model.params.items():  # norms off their ones/zeros start
        if "norm" in name:
            value += 0.2 * rng.normal(size=value.shape)
        if name.endswith("att.b_out") or name.endswith(".b_query") or name.endswith(".b_key") \
                or name.endswith(".b_value"):
            value += 0.1 * rng.normal(size=value.shape)
    oracle = book_gpt(torch)(cfg).double()
    state = {k: torch.from_numpy(v) for k, v in to_torch(model, "book.GPTModel").items()}
    missing, unexpected = oracle.load_state_dict(state, strict=False)
    assert unexpected == [] and all(k.endswith("att.mask") for k in missing)
    return model, oracle


def torch_grads_in_qkvnp_names(torch_model, model):
    """The oracle's ``.grad`` under qkvnp's names, through the layout (transposes undone)."""
    grads = {name: p.grad.numpy() for name, p in torch_model.named_parameters()}
    holder = qkvnp.GPTModel(model.vocab_size, model.context_length, model.emb_dim,
                            model.num_heads, model.num_layers, qkv_bias=model.qkv_bias, rng=0)
    from_torch(holder, grads, "book.GPTModel")
    return holder.params


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_logits_loss_and_every_gradient_match_the_books_gpt(torch, qkv_bias):
    cfg = {**CFG, "qkv_bias": qkv_bias}
    model, oracle = pair(torch, cfg)
    rng = np.random.default_rng(3)
    idx, targets = rng.integers(0, 13, size=(3, 7)), rng.integers(0, 13, size=(3, 7))
    logits = model.forward(idx)
    loss, cache = cross_entropy_forward(logits, targets)
    model.backward(cross_entropy_backward(1.0, cache))

    torch_logits = oracle(torch.from_numpy(idx))
    torch_loss = torch.nn.functional.cross_entropy(torch_logits.flatten(0, 1),
                                                   torch.from_numpy(targets).flatten())
    torch_loss.backward()
    assert logits.shape == (3, 7, 13)
    assert relative(logits, torch_logits.detach().numpy()) <= 1e-10
    assert relative(loss, torch_loss.item()) <= 1e-10
    assert_gradients_match(model.grads, torch_grads_in_qkvnp_names(oracle, model), 1e-10)


def test_replayed_dropout_masks_match_the_books_gpt(torch):
    cfg = {**CFG, "drop_rate": 0.2, "qkv_bias": True}
    model, oracle = pair(torch, cfg)
    rng = np.random.default_rng(4)
    idx, targets = rng.integers(0, 13, size=(2, 8)), rng.integers(0, 13, size=(2, 8))
    masks = {name: rng.random(shape) >= 0.2
             for name, shape in model.dropout_mask_shapes((2,), 8).items()}
    logits = model.forward(idx, dropout_masks=masks)
    loss, cache = cross_entropy_forward(logits, targets)
    model.backward(cross_entropy_backward(1.0, cache))
    torch_logits = oracle(torch.from_numpy(idx), masks)
    torch.nn.functional.cross_entropy(torch_logits.flatten(0, 1),
                                      torch.from_numpy(targets).flatten()).backward()
    # the masks do act: without them the logits differ
    assert relative(model.eval().forward(idx), logits) > 1e-3
    assert relative(logits, torch_logits.detach().numpy()) <= 1e-10
    assert_gradients_match(model.grads, torch_grads_in_qkvnp_names(oracle, model), 1e-10)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_twenty_adamw_steps_match_the_books_training(torch, qkv_bias):
    cfg = {**CFG, "drop_rate": 0.1, "qkv_bias": qkv_bias}
    model, oracle = pair(torch, cfg)
    optimizer = AdamW(model.params, lr=4e-4, weight_decay=0.1)  # the book's chapter 5 settings
    torch_optimizer = torch.optim.AdamW(oracle.parameters(), lr=4e-4, weight_decay=0.1)
    rng = np.random.default_rng(5)
    for _ in range(20):
        idx, targets = rng.integers(0, 13, size=(2, 8)), rng.integers(0, 13, size=(2, 8))
        masks = {name: rng.random(shape) >= 0.1
                 for name, shape in model.dropout_mask_shapes((2,), 8).items()}
        model.zero_grad()
        loss, cache = cross_entropy_forward(model.forward(idx, dropout_masks=masks), targets)
        model.backward(cross_entropy_backward(1.0, cache))
        optimizer.step(model.grads)
        torch_optimizer.zero_grad()
        torch_loss = torch.nn.functional.cross_entropy(
            oracle(torch.from_numpy(idx), masks).flatten(0, 1), torch.from_numpy(targets).flatten())
        torch_loss.backward()
        torch_optimizer.step()
        assert relative(loss, torch_loss.item()) <= 1e-9
    trained = {k: v.detach().numpy() for k, v in oracle.state_dict().items() if "mask" not in k}
    ours = to_torch(model, "book.GPTModel")
    for name, value in ours.items():
        # NOTE: Adam divides b_key's round-off gradient (see assert_gradients_match)
        # by its own root mean square: a step of +-lr in either library, on a
        # parameter the output does not depend on (the losses above agree)
        if not name.endswith("W_key.bias"):
            assert relative(value, trained[name]) <= 1e-9, name


def test_a_trained_model_goes_into_the_books_gpt_and_back_bit_for_bit(torch):
    model, oracle = pair(torch, {**CFG, "qkv_bias": True})
    state = oracle.state_dict()  # with the book's mask buffers
    assert any(k.endswith("att.mask") for k in state)
    back = qkvnp.GPTModel.from_config({**CFG, "qkv_bias": True}, rng=9)
    from_torch(back, state, "book.GPTModel")
    for name, value in model.params.items():
        np.testing.assert_array_equal(back.params[name], value)


def test_a_book_gpt_with_another_head_count_is_refused_naming_the_block(torch):
    """Oracle: the book's GPT itself. Its weights have the same shapes at 2 and 4 heads,
    so only the module's ``num_heads`` tells them apart: loaded into a 4-head model the
    logits differ from the module's, and both directions refuse it, naming the block
    and both counts. At the module's head count the logits agree (the positive control).
    """
    cfg = {**CFG, "emb_dim": 8, "n_heads": 2}
    torch.manual_seed(0)
    module = book_gpt(torch)(cfg).double().eval()
    idx = np.array([[1, 5, 2, 7, 3]])
    expected = module(torch.tensor(idx)).detach().numpy()
    four = qkvnp.GPTModel.from_config({**cfg, "n_heads": 4}, rng=0)
    from_torch(four, module.state_dict(), "book.GPTModel")  # a state dict cannot tell
    assert relative(four.forward(idx), expected) > 1e-3
    before = {name: value.copy() for name, value in four.params.items()}
    match = r"module.trf_blocks.0.att.num_heads=2 but layer.trf_blocks.0.att.num_heads=4"
    with pytest.raises(ValueError, match=match):
        from_torch(four, module, "book.GPTModel")
    for name, value in four.params.items():  # the refused load changed nothing
        np.testing.assert_array_equal(value, before[name])
    with pytest.raises(ValueError, match=match):
        to_torch(four, "book.GPTModel", module=module)
    with pytest.raises(ValueError, match=r"module.trf_blocks.1.att.num_heads=2 but layer.num_heads=4"):
        from_torch(qkvnp.MultiHeadAttention(8, 4, qkv_bias=False, rng=0), module,
                   "book.MultiHeadAttention", prefix="trf_blocks.1.att")
    two = qkvnp.GPTModel.from_config(cfg, rng=0)
    from_torch(two, module, "book.GPTModel")
    assert relative(two.forward(idx), expected) <= 1e-12
    assert set(to_torch(two, "book.GPTModel", module=module)) <= set(module.state_dict())


@pytest.mark.parametrize("edit, match", [
    # a LayerNorm eps other than the book's 1e-5: same scale and shift shapes
    (lambda m, torch: setattr(m.trf_blocks[1].norm2, "eps", 1e-6),
     r"module.trf_blocks.1.norm2.eps=1e-06 but layer.trf_blocks.1.norm2.eps=1e-05"),
    (lambda m, torch: setattr(m.final_norm, "eps", 1e-6), r"module.final_norm.eps=1e-06"),
    # torch's exact GELU in place of the book's tanh form: no weights at all
    (lambda m, torch: m.trf_blocks[0].ff.layers.__setitem__(1, torch.nn.GELU()),
     r"module.trf_blocks.0.ff.layers.1.approximate='none' but layer.trf_blocks.0.ff.layers.1"
     r".approximate='tanh'"),
])
def test_a_book_gpt_with_another_norm_eps_or_gelu_is_refused_naming_it(torch, edit, match):
    """Oracle: the error names the submodule and both values, in both directions."""
    module = book_gpt(torch)(CFG).double()
    edit(module, torch)
    model = qkvnp.GPTModel.from_config(CFG, rng=0)
    with pytest.raises(ValueError, match=match):
        from_torch(model, module, "book.GPTModel")
    with pytest.raises(ValueError, match=match):
        to_torch(model, "book.GPTModel", module=module)
