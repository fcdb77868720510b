"""qkvnp.interop against real torch modules, and the book's printed numbers.

Oracles: PyTorch autograd on ``nn.MultiheadAttention`` and on the book's
chapter 3 layers (rebuilt in :mod:`book_layers` and built under the book's
seeds); the context vectors the book prints (:data:`book_layers.PRINTED`,
4 decimals); for round trips, exact equality.

After :func:`qkvnp.interop.from_torch`, outputs, input gradients and every
parameter gradient agree with torch's to 1e-10 in float64 (scaled by
``max(1, max|torch|)``), on each path of the layers, with a random upstream
gradient. Shape key: B batch, T query length, S key length, E embedding.
"""
import numpy as np
import pytest

import qkvnp
from qkvnp.interop import LAYOUTS, from_torch, to_torch

from book_layers import INPUTS, PRINTED, book_layers
from oracles import torch_mha_param_grads

TOLERANCE = 1e-10  # float64, scaled by max(1, max|torch|)
MHA = "torch.nn.MultiheadAttention"


def assert_agrees(what, ours, theirs):
    """Shape first, then ``max|ours - torch| / max(1, max|torch|) <= TOLERANCE``."""
    theirs = theirs.detach().numpy() if hasattr(theirs, "detach") else np.asarray(theirs)
    assert ours.shape == theirs.shape, f"{what}: shape {ours.shape} != torch's {theirs.shape}"
    error = np.abs(ours - theirs).max() / max(1.0, np.abs(theirs).max())
    assert error <= TOLERANCE, f"{what}: error {error:.3g} > {TOLERANCE:g}"


def qkvnp_twin(name, args, qkv_bias, impl):
    """The qkvnp layer that a book layer's weights load into, and its forward options."""
    if name == "MultiHeadAttention":
        d_in, d_out, _, _, num_heads = args
        return qkvnp.MultiHeadAttention(embed_dim=d_out, num_heads=num_heads, qdim=d_in,
                                        kdim=d_in, vdim=d_in, qkv_bias=qkv_bias, out_bias=True,
                                        impl=impl), {"is_causal": True}
    layer = qkvnp.SelfAttention(args[0], args[1], qkv_bias=qkv_bias, impl=impl)
    return layer, {"is_causal": name == "CausalAttention"}


def book_module(torch, name, args, seed, qkv_bias=False):
    """The book's layer under its seed (float32 as in the book), then in float64."""
    torch.manual_seed(seed)
    extra = {"qkv_bias": True} if qkv_bias else {}
    return book_layers(torch)[name](*args, **extra).double()


@pytest.mark.parametrize("impl", ["reference", "fast", "tiled"])
@pytest.mark.parametrize("name", sorted(PRINTED))
def test_book_layers_print_the_books_numbers_and_torchs_gradients(torch, name, impl):
    """Oracle: the book's printed context vectors (4 decimals) and torch autograd.

    Each book layer is built under the notebook's seed; its ``state_dict``
    (with the ``mask`` buffer, which is ignored) loads into the qkvnp twin.
    """
    seed, args, batched, printed = PRINTED[name]
    module = book_module(torch, name, args, seed)
    layer, options = qkvnp_twin(name, args, False, impl)
    from_torch(layer, module.state_dict(), "book." + name)
    x = np.stack([INPUTS, INPUTS]) if batched else INPUTS  # the book's batch: two copies
    out = layer.forward(x, **options)
    assert out.shape == x.shape[:-1] + (args[1],)
    np.testing.assert_allclose(out[0] if batched else out, printed, rtol=0, atol=5e-5)
    x_torch = torch.tensor(x, requires_grad=True)
    out_torch = module(x_torch)
    assert_agrees("output", out, out_torch)
    dout = np.random.default_rng(0).standard_normal(out.shape)
    out_torch.backward(torch.tensor(dout))
    assert_agrees("input gradient", layer.backward(dout), x_torch.grad)
    grads = _grads_as_torch(layer, "book." + name)  # in torch's names and layout
    assert sorted(grads) == sorted(n for n, _ in module.named_parameters())
    for torch_name, parameter in module.named_parameters():
        assert_agrees(f"grad {torch_name}", grads[torch_name], parameter.grad)


def _grads_as_torch(layer, layout):
    """The layer's gradients under the torch names (to_torch of a layer holding them)."""
    saved = {name: value.copy() for name, value in layer.params.items()}
    for name, value in layer.params.items():
        value[...] = layer.grads[name]
    try:
        return to_torch(layer, layout)
    finally:
        layer.load_state_dict(saved)


@pytest.mark.parametrize("name", ["SelfAttention_v2", "CausalAttention", "MultiHeadAttention"])
def test_book_layers_with_qkv_bias(torch, name):
    """Oracle: torch autograd, with the book's ``qkv_bias=True`` (biases randomized)."""
    seed, args, _, _ = PRINTED[name]
    module = book_module(torch, name, args, seed, qkv_bias=True)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.uniform_(-1, 1)
    layer, options = qkvnp_twin(name, args, True, "auto")
    from_torch(layer, module.state_dict(), "book." + name)
    x = np.random.default_rng(1).standard_normal((2, 5, 3))
    x_torch = torch.tensor(x, requires_grad=True)
    out_torch = module(x_torch)
    out = layer.forward(x, **options)
    assert_agrees("output", out, out_torch)
    dout = np.random.default_rng(2).standard_normal(out.shape)
    out_torch.backward(torch.tensor(dout))
    assert_agrees("input gradient", layer.backward(dout), x_torch.grad)
    grads = _grads_as_torch(layer, "book." + name)
    for torch_name, parameter in module.named_parameters():
        assert_agrees(f"grad {torch_name}", grads[torch_name], parameter.grad)


# (E, H, kdim, vdim, bias): packed in_proj_weight; separate q/k/v_proj_weight; no biases
MHA_CASES = [(8, 2, None, None, True), (6, 3, 5, 4, True), (8, 4, None, None, False)]


@pytest.mark.parametrize("impl", ["reference", "fast", "tiled"])
@pytest.mark.parametrize("E, H, kdim, vdim, bias", MHA_CASES)
def test_torch_multihead_attention_loads_with_outputs_and_all_gradients(torch, impl, E, H,
                                                                         kdim, vdim, bias):
    """Oracle: ``nn.MultiheadAttention(batch_first=True)`` autograd, float64."""
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim,
                                         batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.uniform_(-0.5, 0.5)  # nonzero biases too
    layer = qkvnp.MultiHeadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, impl=impl)
    from_torch(layer, module.state_dict(), MHA)
    rng = np.random.default_rng(3)
    query = rng.standard_normal((2, 4, E))
    key = rng.standard_normal((2, 5, kdim or E))
    value = rng.standard_normal((2, 5, vdim or E))
    tensors = [torch.tensor(a, requires_grad=True) for a in (query, key, value)]
    causal = torch.triu(torch.ones(4, 5, dtype=torch.bool), diagonal=1)  # True = blocked
    out_torch, _ = module(*tensors, attn_mask=causal, need_weights=False)
    out = layer.forward(query, key, value, attn_mask=~causal.numpy())  # True = may attend
    assert_agrees("output", out, out_torch)
    dout = rng.standard_normal(out.shape)
    out_torch.backward(torch.tensor(dout))
    for i, grad in enumerate(layer.backward(dout)):
        assert_agrees(f"input {i} gradient", grad, tensors[i].grad)
    theirs = torch_mha_param_grads(module, E)
    assert sorted(theirs) == sorted(layer.grads)
    for name, grad in layer.grads.items():
        assert_agrees(f"grad {name}", grad, theirs[name])


@pytest.mark.parametrize("E, H, kdim, vdim, bias", MHA_CASES)
def test_torch_round_trips_give_identical_arrays(torch, E, H, kdim, vdim, bias):
    """Oracle: exact equality, torch -> qkvnp -> torch and qkvnp -> torch -> qkvnp."""
    module = torch.nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim,
                                         batch_first=True, dtype=torch.float64)
    layer = qkvnp.MultiHeadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, rng=5)
    original = layer.state_dict()
    state = to_torch(layer, MHA)
    assert list(state) == list(module.state_dict())  # the names torch itself uses
    module.load_state_dict({name: torch.from_numpy(value) for name, value in state.items()})
    back = qkvnp.MultiHeadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, rng=6)
    from_torch(back, module.state_dict(), MHA)
    for name, value in original.items():
        assert np.array_equal(back.params[name], value), name
    for name, value in to_torch(back, MHA).items():
        assert np.array_equal(value, module.state_dict()[name].numpy()), name


# the attention layouts; book.GPTModel's round trip is in tests/models/test_gpt_torch.py
@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS[1:] if layout != "book.GPTModel"])
def test_book_round_trips_and_loads_into_torch(torch, layout):
    """Oracle: exact equality; to_torch's names and shapes load into the book's module."""
    name = layout.split(".", 1)[1]
    seed, args, _, _ = PRINTED[name]
    module = book_module(torch, name, args, seed)
    layer, _ = qkvnp_twin(name, args, False, "auto")
    state = to_torch(layer, layout)
    missing, unexpected = module.load_state_dict(
        {key: torch.from_numpy(value) for key, value in state.items()}, strict=False)
    assert unexpected == [] and set(missing) <= {"mask"}
    back, _ = qkvnp_twin(name, args, False, "auto")
    from_torch(back, module.state_dict(), layout)
    for key, value in layer.params.items():
        assert np.array_equal(back.params[key], value), key


def test_float32_tensors_with_grad_are_cast_by_duck_typing(torch):
    """Oracle: the tensor's own values, cast exactly; the layer's arrays kept (in place)."""
    module = torch.nn.MultiheadAttention(4, 2, batch_first=True)  # float32, requires_grad
    layer = qkvnp.MultiHeadAttention(4, 2, rng=0)
    W_out = layer.params["W_out"]
    from_torch(layer, dict(module.named_parameters()), MHA)
    assert layer.params["W_out"] is W_out and W_out.dtype == np.float64
    assert np.array_equal(W_out, module.out_proj.weight.detach().numpy().T.astype(np.float64))


def test_misfits_are_refused_saying_what_differs(torch):
    """Oracle: the error names what differs; a refused load leaves the layer unchanged."""
    module = torch.nn.MultiheadAttention(4, 2, add_bias_kv=True, batch_first=True)
    layer = qkvnp.MultiHeadAttention(4, 2, rng=0)
    before = layer.state_dict()
    with pytest.raises(ValueError, match="bias_k.*add_bias_kv"):
        from_torch(layer, module.state_dict(), MHA)
    state = to_torch(layer, MHA)
    with pytest.raises(ValueError, match="layout must be one of"):
        from_torch(layer, state, "torch.nn.Transformer")
    with pytest.raises(ValueError, match="loads a qkvnp.SelfAttention"):
        from_torch(layer, state, "book.SelfAttention_v2")
    with pytest.raises(ValueError, match="biases the layer lacks"):
        from_torch(qkvnp.MultiHeadAttention(4, 2, bias=False), state, MHA)
    with pytest.raises(ValueError, match=r"missing \['in_proj_bias'\].*biases the state dict lacks"):
        from_torch(layer, {k: v for k, v in state.items() if k != "in_proj_bias"}, MHA)
    with pytest.raises(ValueError, match=r"state_dict\['out_proj.weight'\] must have shape \(4, 4\)"):
        from_torch(layer, {**state, "out_proj.weight": np.ones((4, 3))}, MHA)
    with pytest.raises(ValueError, match=r"out_proj.bias'\] contains NaN"):
        from_torch(layer, {**state, "out_proj.bias": np.full(4, np.nan)}, MHA)
    with pytest.raises(TypeError, match="in_proj_bias"):
        from_torch(layer, {**state, "in_proj_bias": np.ones(12, complex)}, MHA)
    for name, value in layer.params.items():
        assert np.array_equal(value, before[name]), name
    with pytest.raises(ValueError, match="qdim=3"):
        to_torch(qkvnp.MultiHeadAttention(4, 2, qdim=3, kdim=3, vdim=3), MHA)
    with pytest.raises(ValueError, match="qkv_bias=False, out_bias=True"):
        to_torch(qkvnp.MultiHeadAttention(4, 2, qkv_bias=False, out_bias=True), MHA)
    with pytest.raises(ValueError, match="out_bias=False"):
        to_torch(qkvnp.MultiHeadAttention(2, 2, out_bias=False), "book.MultiHeadAttention")
    with pytest.raises(ValueError, match="no biases"):
        to_torch(qkvnp.SelfAttention(3, 2, qkv_bias=True), "book.SelfAttention_v1")
    shared_kv = qkvnp.MultiHeadAttention(4, 2, rng=0)
    shared_kv.num_kv_heads = 1  # as a grouped-query layer would say (no torch layout has it)
    with pytest.raises(ValueError, match="num_kv_heads=1, num_heads=2"):
        to_torch(shared_kv, MHA)
    square = qkvnp.MultiHeadAttention(4, 2, rng=1)  # separate q/k/v weights also load
    separate = torch.nn.MultiheadAttention(4, 2, kdim=5, vdim=5).state_dict()
    separate["k_proj_weight"] = separate["k_proj_weight"][:, :4]
    separate["v_proj_weight"] = separate["v_proj_weight"][:, :4]
    from_torch(square, separate, MHA)
    assert np.array_equal(square.params["W_key"], separate["k_proj_weight"].numpy().T)


def test_a_layer_inside_a_larger_torch_model_loads_with_its_prefix(torch):
    """Oracle: torch autograd on the layer inside its model (a stack of two
    book MultiHeadAttention blocks, as the book's GPT names them
    ``trf_blocks.<i>.att``, beside other weights), and exact equality for the
    round trip back into the whole model's state_dict."""
    seed, args, _, _ = PRINTED["MultiHeadAttention"]
    torch.manual_seed(seed)
    Book = book_layers(torch)["MultiHeadAttention"]

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.att = Book(*args)
            self.norm = torch.nn.LayerNorm(args[1])

    class GPTish(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb = torch.nn.Embedding(5, args[0])
            self.trf_blocks = torch.nn.Sequential(Block(), Block())

    model = GPTish().double()
    state = model.state_dict()
    layer, options = qkvnp_twin("MultiHeadAttention", args, False, "auto")
    with pytest.raises(ValueError, match=r"prefix \('trf_blocks.0.att.', 'trf_blocks.1.att.'\)"):
        from_torch(layer, state, "book.MultiHeadAttention")
    with pytest.raises(ValueError, match="no key under prefix 'trf_blocks.2.att.'"):
        from_torch(layer, state, "book.MultiHeadAttention", prefix="trf_blocks.2.att.")
    with pytest.raises(TypeError, match="prefix must be a str"):
        from_torch(layer, state, "book.MultiHeadAttention", prefix=1)
    from_torch(layer, state, "book.MultiHeadAttention", prefix="trf_blocks.1.att.")
    x = np.stack([INPUTS, INPUTS])
    x_torch = torch.tensor(x, requires_grad=True)
    out_torch = model.trf_blocks[1].att(x_torch)
    out = layer.forward(x, **options)
    assert_agrees("output", out, out_torch)
    dout = np.random.default_rng(1).standard_normal(out.shape)
    out_torch.backward(torch.tensor(dout))
    assert_agrees("input gradient", layer.backward(dout), x_torch.grad)
    for value in layer.params.values():
        value *= 2.0
    back = to_torch(layer, "book.MultiHeadAttention", prefix="trf_blocks.0.att.")
    assert all(name.startswith("trf_blocks.0.att.") for name in back)
    result = model.load_state_dict({name: torch.from_numpy(value) for name, value in back.items()},
                                   strict=False)
    assert sorted(result.unexpected_keys) == []
    assert sorted(result.missing_keys) == sorted(
        name for name in state if not name.startswith("trf_blocks.0.att.")
        or name.endswith(".mask"))
    for name, value in back.items():
        assert np.array_equal(model.state_dict()[name].numpy(), value), name


# ---------------------------------------------------------------- prefixes, bfloat16, modules


@pytest.mark.parametrize("layout, layer", [
    (MHA, lambda: qkvnp.MultiHeadAttention(4, 2, rng=0)),
    ("book.SelfAttention_v2", lambda: qkvnp.SelfAttention(3, 2, True, rng=0)),
])
def test_a_prefix_without_its_dot_is_the_same_prefix_both_ways(layout, layer):
    """Oracle: the same call with the dot (torch joins module and parameter names with one).

    Was: to_torch(prefix="enc") gave "encin_proj_weight", and from_torch refused it with
    advice about kdim."""
    source = layer()
    dotted = to_torch(source, layout, prefix="enc.")
    undotted = to_torch(source, layout, prefix="enc")
    assert sorted(undotted) == sorted(dotted)
    for name, value in undotted.items():
        assert np.array_equal(value, dotted[name]), name
    target = qkvnp.MultiHeadAttention(4, 2, rng=1) if layout == MHA else \
        qkvnp.SelfAttention(3, 2, True, rng=1)
    from_torch(target, {**dotted, "other.weight": np.ones(3)}, layout, prefix="enc")
    for name, value in source.params.items():
        assert np.array_equal(target.params[name], value), name


def test_bfloat16_tensors_are_cast_as_torch_load_state_dict_casts(torch):
    """Oracle: torch's own load_state_dict of the bfloat16 state into a float64 module.

    Was: TypeError "unsupported ScalarType BFloat16"."""
    torch.manual_seed(0)
    half = torch.nn.MultiheadAttention(4, 2, batch_first=True).to(torch.bfloat16)
    full = torch.nn.MultiheadAttention(4, 2, batch_first=True).double()
    full.load_state_dict(half.state_dict())
    for dtype in (np.float64, np.float32):
        layer = qkvnp.MultiHeadAttention(4, 2, rng=0, dtype=dtype)
        from_torch(layer, half.state_dict(), MHA)
        expected = to_torch(layer, MHA)
        for name, value in full.state_dict().items():
            assert np.array_equal(expected[name], value.numpy().astype(dtype)), name


def test_a_torch_module_loads_as_its_state_dict(torch):
    """Oracle: the same load from the module's state_dict(), exactly."""
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(4, 2, batch_first=True)
    from_module, from_state = qkvnp.MultiHeadAttention(4, 2, rng=0), qkvnp.MultiHeadAttention(4, 2, rng=0)
    from_torch(from_module, module, MHA)
    from_torch(from_state, module.state_dict(), MHA)
    for name, value in from_state.params.items():
        assert np.array_equal(from_module.params[name], value), name


@pytest.mark.parametrize("options, match", [
    # the state dict of add_zero_attn=True is that of a plain layer: it loaded silently, and
    # the outputs then differed by 0.079
    ({"add_zero_attn": True}, r"built with add_zero_attn=True"),
    ({"add_bias_kv": True}, r"built with add_bias_kv=True"),
    ({"num_heads": 4}, r"module.num_heads=4 but layer.num_heads=2"),
])
def test_a_module_with_an_option_qkvnp_lacks_is_refused_naming_it(torch, options, match):
    """Oracle: the error names the option; the refused load leaves the layer unchanged."""
    module = torch.nn.MultiheadAttention(**{"embed_dim": 4, "num_heads": 2, **options},
                                         batch_first=True)
    layer = qkvnp.MultiHeadAttention(4, 2, rng=0)
    before = layer.state_dict()
    with pytest.raises(ValueError, match=match):
        from_torch(layer, module, MHA)
    for name, value in layer.params.items():
        assert np.array_equal(value, before[name]), name


def test_errors_on_a_12_layer_gpt_are_short_and_name_the_offending_key():
    """Oracle: the message's length (a 12-layer model's repr alone is over 7 KB) and the
    key or option it must name: a line or two that still says what differs."""
    model = qkvnp.GPTModel(vocab_size=50, context_length=8, emb_dim=8, num_heads=2,
                           num_layers=12, rng=0)
    assert len(repr(model)) > 5000
    state = to_torch(model, "book.GPTModel")
    biased = to_torch(qkvnp.GPTModel(50, 8, 8, 2, 12, qkv_bias=True, rng=0), "book.GPTModel")
    bad_shape = {**state, "trf_blocks.11.ff.layers.0.weight": np.ones((3, 8))}
    cases = [
        (biased, r"unexpected \['trf_blocks.0.att.W_key.bias', .*\(36 in all\)"),
        ({k: v for k, v in state.items() if "norm2" not in k},
         r"missing \['trf_blocks.0.norm2.scale', .*\(24 in all\)"),
        ({"gpt." + k: v for k, v in state.items()}, r"prefix \('gpt.'\)"),
        (bad_shape, r"state_dict\['trf_blocks.11.ff.layers.0.weight'\] must have shape \(32, 8\)"),
    ]
    for state_dict, match in cases:
        with pytest.raises(ValueError, match=match) as error:
            from_torch(model, state_dict, "book.GPTModel")
        message = str(error.value)
        assert len(message) < 500 and "\n" not in message, (len(message), message[:300])
        assert "GPTModel(vocab_size=50, context_length=8, emb_dim=8, num_heads=2, " \
               "num_layers=12)" in message


@pytest.mark.parametrize("options, match", [
    ({"add_zero_attn": True}, r"built with add_zero_attn=True"),
    ({"num_heads": 4}, r"module.attn.num_heads=4 but layer.num_heads=2"),
])
def test_a_module_inside_a_larger_one_is_checked_at_its_prefix(torch, options, match):
    """Oracle: the error names the option of the submodule ``prefix`` names (the outer
    module has no ``num_heads`` or ``add_zero_attn`` of its own), in both directions."""

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(**{"embed_dim": 4, "num_heads": 2, **options},
                                                    batch_first=True)

    holder, layer = Holder(), qkvnp.MultiHeadAttention(4, 2, rng=0)
    with pytest.raises(ValueError, match=match):
        from_torch(layer, holder, MHA, prefix="attn")
    with pytest.raises(ValueError, match=match):
        to_torch(layer, MHA, prefix="attn.", module=holder)
    with pytest.raises(TypeError, match="module must be a torch module"):
        to_torch(layer, MHA, module=holder.state_dict())
