"""Weights in and out of PyTorch's layouts, without importing torch.

Shape key: E embedding (the projected width the heads split; the book's
``d_out``), ``qdim``/``kdim``/``vdim`` the query/key/value input widths (the
book's ``d_in``), ``out_dim`` the output width.

:func:`from_torch` loads a PyTorch ``state_dict`` into a qkvnp layer, in
place; :func:`to_torch` gives a layer's parameters under the torch names, as
numpy arrays. The values may be numpy arrays or torch tensors (converted by
duck typing, ``.detach().cpu().numpy()``). The layouts (:data:`LAYOUTS`):

=================================  ======================  ===================================
layout                             qkvnp layer             torch names
=================================  ======================  ===================================
``"torch.nn.MultiheadAttention"``  MultiHeadAttention      ``in_proj_weight (3E, E)`` or
                                                           ``q/k/v_proj_weight (E, in)`` when
                                                           kdim/vdim differ from E,
                                                           ``in_proj_bias (3E,)``,
                                                           ``out_proj.weight/bias``
``"book.SelfAttention_v1"``        SelfAttention           ``W_query (d_in, d_out)``, ... as is
``"book.SelfAttention_v2"``        SelfAttention           ``W_query.weight (d_out, d_in)``,
                                                           ``W_query.bias`` with ``qkv_bias``
``"book.CausalAttention"``         SelfAttention           as v2; call with ``is_causal=True``
``"book.MultiHeadAttention"``      MultiHeadAttention      as v2, and ``out_proj.weight``,
                                                           ``out_proj.bias``
``"book.GPTModel"``                GPTModel                ``tok_emb.weight``,
                                                           ``pos_emb.weight``,
                                                           ``trf_blocks.N.att.*`` (as
                                                           above), ``...ff.layers.0.weight``
                                                           / ``.bias``, ``...ff.layers.2.*``,
                                                           ``...norm1.scale`` / ``shift``,
                                                           ``...norm2.*``, ``final_norm.*``,
                                                           ``out_head.weight`` (a tied
                                                           model's token table, and a
                                                           tied model refuses one that
                                                           differs from it)
=================================  ======================  ===================================

torch's ``nn.Linear`` stores ``weight`` as ``(out_features, in_features)`` and
computes ``x @ weight.T``; qkvnp computes ``x @ W``, so ``W = weight.T``
(the book's ``SelfAttention_v1`` already holds ``x @ W`` matrices). The book's
``mask`` buffer is not a weight: :func:`from_torch` ignores it and
:func:`to_torch` does not produce it (load into torch with ``strict=False``).
What a state dict cannot say is the layer's head count and causality (nor
a LayerNorm's ``eps``, nor an ``nn.GELU``'s ``approximate``): build the
qkvnp layer with the torch layer's ``num_heads`` and call it with the
book's ``is_causal=True``. Pass the torch module itself (to
:func:`from_torch` as the ``state_dict``, to :func:`to_torch` as
``module=``) and these settings are checked: a difference is refused,
naming the submodule and both values.

Examples
--------
>>> import numpy as np
>>> from qkvnp import MultiHeadAttention
>>> from qkvnp.interop import from_torch, to_torch
>>> layer = MultiHeadAttention(4, 2, rng=0)
>>> state = to_torch(layer, "torch.nn.MultiheadAttention")
>>> sorted(state)
['in_proj_bias', 'in_proj_weight', 'out_proj.bias', 'out_proj.weight']
>>> state["in_proj_weight"].shape
(12, 4)
>>> copy = MultiHeadAttention(4, 2, rng=1)
>>> from_torch(copy, state, "torch.nn.MultiheadAttention")
>>> bool(np.array_equal(copy.params["W_query"], layer.params["W_query"]))
True
"""
from __future__ import annotations


import numpy as np

from .._checks import check_state_value
from ..models.gpt import GPTModel
from ..layers import MultiHeadAttention, SelfAttention
from ..layers.lora import adapted_layers

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any, Mapping

__all__ = ["LAYOUTS", "from_torch", "to_torch"]

#: The layouts :func:`from_torch` and :func:`to_torch` know.
LAYOUTS = ("torch.nn.MultiheadAttention", "book.SelfAttention_v1", "book.SelfAttention_v2",
           "book.CausalAttention", "book.MultiHeadAttention", "book.GPTModel")

_ROLES = ("query", "key", "value")


def _check_layout(layer, layout):
    """The layer class the layout needs; refuse an unknown layout or another layer class."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "book.GPTModel":
        if not isinstance(layer, GPTModel):
            raise ValueError(f"layout {layout!r} loads a qkvnp.GPTModel, got "
                             f"{type(layer).__name__}")
        adapted = adapted_layers(layer)
        if adapted:
            raise ValueError(f"the GPTModel has LoRA adapters at {adapted}, which the book's "
                             f"GPTModel has no place for: merge them first "
                             f"(qkvnp.layers.merge_lora(model))")
        differs = [f"{name}={value!r}" for name, value, book in (
            ("hidden_dim", layer.hidden_dim, 4 * layer.emb_dim),
            ("approximate", layer.approximate, "tanh")) if value != book]
        if differs:
            raise ValueError(f"the book's GPTModel has a feed-forward of width 4 * emb_dim with "
                             f"the tanh GELU; the model has {', '.join(differs)}")
        for i, block in enumerate(layer.trf_blocks):
            try:
                _check_layout(block.att, "book.MultiHeadAttention")
            except ValueError as error:
                raise ValueError(f"layout {layout!r}: trf_blocks.{i}.att does not fit the "
                                 f"book's attention: {error}") from None
        return GPTModel
    needed = MultiHeadAttention if layout.endswith("MultiheadAttention") or \
        layout.endswith("MultiHeadAttention") else SelfAttention
    if not isinstance(layer, needed):
        raise ValueError(f"layout {layout!r} loads a qkvnp.{needed.__name__}, got "
                         f"{type(layer).__name__}")
    # NOTE: neither torch's layer nor the book's shares key/value heads: a
    # layer with fewer key/value heads (num_kv_heads) has no
    # layout here
    # NOTE: neither has the attention variants either: a layer with RoPE, a
    # window, ALiBi, sinks... would load as a layer computing something else
    variants = getattr(layer, "variants", None)
    if variants is not None:
        on = [f"{name}={value!r}" for name, value in layer._variant_repr_items()]
        raise ValueError(f"layout {layout!r} has none of the attention variants; the layer has "
                         f"{', '.join(on)}")
    kv_heads = getattr(layer, "num_kv_heads", None)
    if needed is MultiHeadAttention and kv_heads not in (None, layer.num_heads):
        raise ValueError(f"layout {layout!r} has one key/value head per query head; the layer "
                         f"has num_kv_heads={kv_heads}, num_heads={layer.num_heads}")
    if layout == "torch.nn.MultiheadAttention":
        differs = [f"{name}={getattr(layer, name)}" for name in ("qdim", "out_dim")
                   if getattr(layer, name) != layer.embed_dim]
        if differs:
            raise ValueError(f"torch.nn.MultiheadAttention's query and output widths are "
                             f"embed_dim={layer.embed_dim}; the layer has {', '.join(differs)}")
        if layer.qkv_bias != layer.out_bias:
            raise ValueError(f"torch.nn.MultiheadAttention has one bias flag for every "
                             f"projection; the layer has qkv_bias={layer.qkv_bias}, "
                             f"out_bias={layer.out_bias}")
    if layout == "book.MultiHeadAttention":
        if not layer.qdim == layer.kdim == layer.vdim:
            raise ValueError(f"the book's MultiHeadAttention projects one input (d_in); the "
                             f"layer has qdim={layer.qdim}, kdim={layer.kdim}, vdim={layer.vdim}")
        if layer.out_dim != layer.embed_dim or not layer.out_bias:
            raise ValueError(f"the book's out_proj is nn.Linear(d_out, d_out) with a bias; the "
                             f"layer has embed_dim={layer.embed_dim}, out_dim={layer.out_dim}, "
                             f"out_bias={layer.out_bias}")
    if layout == "book.SelfAttention_v1" and layer.qkv_bias:
        raise ValueError("the book's SelfAttention_v1 has no biases; the layer has qkv_bias=True")
    return needed


def _packed(layer):
    """True when torch packs the input projections (kdim == vdim == embed_dim)."""
    return layer.kdim == layer.embed_dim and layer.vdim == layer.embed_dim


def to_torch(layer: Any, layout: str, *, prefix: str = "", module: Any = None) -> dict[str, Any]:
    """The layer's parameters under ``layout``'s torch names, as numpy arrays.

    Parameters
    ----------
    layer : SelfAttention, MultiHeadAttention or GPTModel
    layout : str
        One of :data:`LAYOUTS`.
    prefix : str, keyword-only
        Put before every name: the layer's place in a larger torch model
        (``"trf_blocks.0.att."``), as that model's ``state_dict`` names it.
        A prefix without its trailing dot gets one (``"enc"`` is ``"enc."``),
        as in :func:`from_torch`.
    module : torch.nn.Module, keyword-only, optional
        The module the state will be loaded into (the layer at ``prefix``
        in it). What the weights' shapes cannot show is checked against the
        layer, as :func:`from_torch` checks a module: each attention's
        ``num_heads``, the GPT's LayerNorm ``eps`` and an ``nn.GELU``'s
        ``approximate``, ``nn.MultiheadAttention``'s ``add_zero_attn`` and
        ``add_bias_kv``. Without it, nothing can check them: build the
        module with the layer's settings.

    Returns
    -------
    dict
        ``torch name -> ndarray`` (new C-contiguous arrays in the layer's
        dtype: ``torch.from_numpy`` takes them as they are).

    Raises
    ------
    ValueError
        If ``layout`` is unknown or does not fit the layer (its class, its
        widths, its biases), or ``module``'s settings differ from the
        layer's; the message says what differs.
    """
    _check_layout(layer, layout)
    prefix = _check_prefix(prefix)
    if module is not None:
        if not _is_module(module):
            raise TypeError(f"module must be a torch module (the state's destination), got "
                            f"{type(module).__name__}")
        _check_module(layer, layout, module, prefix)
    if layout == "book.GPTModel":
        return {prefix + name: value for name, value in _gpt_to_torch(layer).items()}
    p = layer.params
    state = {}
    if layout == "book.SelfAttention_v1":
        state = {f"W_{role}": p[f"W_{role}"] for role in _ROLES}
    elif layout == "torch.nn.MultiheadAttention":
        if _packed(layer):
            state["in_proj_weight"] = np.concatenate([p[f"W_{r}"].T for r in _ROLES])  # (3E, E)
        else:
            state.update({f"{r[0]}_proj_weight": p[f"W_{r}"].T for r in _ROLES})  # (E, in)
        if layer.qkv_bias:
            state["in_proj_bias"] = np.concatenate([p[f"b_{r}"] for r in _ROLES])  # (3E,)
        state["out_proj.weight"] = p["W_out"].T  # (E, E)
        if layer.out_bias:
            state["out_proj.bias"] = p["b_out"]
    else:  # the book's nn.Linear projections
        for role in _ROLES:
            state[f"W_{role}.weight"] = p[f"W_{role}"].T  # (in, E) -> (E, in)
            if layer.qkv_bias:
                state[f"W_{role}.bias"] = p[f"b_{role}"]
        if layout == "book.MultiHeadAttention":
            state["out_proj.weight"] = p["W_out"].T  # (E, E)
            state["out_proj.bias"] = p["b_out"]
    return {prefix + name: np.array(value, order="C") for name, value in state.items()}


def _check_prefix(prefix):
    """``prefix`` with its trailing dot: ``"enc"`` and ``"enc."`` name the same layer."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str (e.g. 'trf_blocks.0.att.'), got "
                        f"{type(prefix).__name__}")
    # NOTE: torch joins a module's name and its parameters' with a dot, so a
    # prefix without one can only mean the module's name
    return prefix if prefix == "" or prefix.endswith(".") else prefix + "."


def _is_module(value):
    """A torch ``nn.Module`` by duck typing: a ``state_dict()`` method and no mapping."""
    return callable(getattr(value, "state_dict", None)) and not hasattr(value, "keys")


def _settings(layer, layout):
    """``(module name, qkvnp layer, attribute)`` of every setting the weights' shapes cannot
    show: a torch module of ``layout`` names it alike and must hold the layer's value."""
    if layout == "book.GPTModel":
        for i, block in enumerate(layer.trf_blocks):
            yield f"trf_blocks.{i}.att", block.att, "num_heads"
            yield f"trf_blocks.{i}.norm1", block.norm1, "eps"
            yield f"trf_blocks.{i}.norm2", block.norm2, "eps"
            yield f"trf_blocks.{i}.ff.layers.1", block.ff.layers[1], "approximate"  # nn.GELU's
        yield "final_norm", layer.final_norm, "eps"
    elif isinstance(layer, MultiHeadAttention):
        yield "", layer, "num_heads"


def _check_module(layer, layout, module, prefix):
    """Refuse a torch ``module`` (the layer at ``prefix`` in it) whose options or settings,
    which its state dict cannot show, differ from the layer's; name each."""
    modules = dict(module.named_modules())
    target = modules.get(prefix[:-1] if prefix else "")
    if type(target).__name__ == "MultiheadAttention":
        if getattr(target, "add_zero_attn", False):
            raise ValueError("the nn.MultiheadAttention was built with add_zero_attn=True: it "
                             "attends to an extra all-zero key and value, which qkvnp does not "
                             "support")
        if getattr(target, "bias_k", None) is not None or \
                getattr(target, "bias_v", None) is not None:
            raise ValueError("the nn.MultiheadAttention was built with add_bias_kv=True: it "
                             "appends a learned key and value to every sequence, which qkvnp "
                             "does not support")
    differs = []
    for name, sublayer, setting in _settings(layer, layout):
        theirs = getattr(modules.get((prefix + name).rstrip(".")), setting, None)
        ours = getattr(sublayer, setting)
        # NOTE: a module without the attribute (the book's GELU class is the tanh
        # form, its attention has no kv heads) fixes it by its class: the layout's
        if isinstance(theirs, (bool, int, float, str)) and theirs != ours:
            differs.append(f"module.{prefix + name}{'.' if name else ''}{setting}={theirs!r} "
                           f"but layer.{name}{'.' if name else ''}{setting}={ours!r}")
    if differs:
        raise ValueError(f"the torch module's settings that its state dict cannot show differ "
                         f"from the layer's ({_describe(layer)}): {_some(differs, 3, '; ')}; "
                         "build the layer with the module's settings")


_SUMMARY_FIELDS = ("vocab_size", "context_length", "emb_dim", "num_heads", "num_layers")


def _describe(layer):
    """The layer in one short line for a message: its repr, or a composite's class and sizes."""
    text = repr(layer)
    if "\n" not in text and len(text) <= 200:
        return text
    fields = [f"{name}={getattr(layer, name)!r}" for name in _SUMMARY_FIELDS
              if hasattr(layer, name)]
    return f"{type(layer).__name__}({', '.join(fields)})"


def _some(items, limit=3, separator=", "):
    """The first ``limit`` of ``items`` (sorted) in one line, with how many there are in all."""
    items = sorted(items)
    shown = separator.join(str(item) for item in items[:limit])
    if len(items) > limit:
        return f"{shown}{separator}... ({len(items)} in all)"
    return shown


def _prefix_hint(layout, unexpected, expected):
    """A hint when the unexpected keys are the expected ones under a common prefix."""
    prefixes = {key[:-len(name)] for key in unexpected for name in expected
                if key.endswith("." + name)}
    if not prefixes:
        return None
    return (f"its keys carry a prefix ({', '.join(repr(p) for p in sorted(prefixes)[:3])}): "
            f"pass it, from_torch(layer, state_dict, {layout!r}, prefix=...)")


def _missing_message(layout, layer, missing, unexpected):
    """Why the keys differ, in the layer's terms (biases, packed projections, bias_k)."""
    hints = []
    if any(name.endswith("bias") for name in unexpected):
        hints.append("the state dict has biases the layer lacks (build it with qkv_bias=True "
                     "/ bias=True)")
    if any(name.endswith("bias") for name in missing):
        hints.append("the layer has biases the state dict lacks (build it with "
                     "qkv_bias=False / bias=False)")
    if "in_proj_weight" in missing or "q_proj_weight" in missing:
        hints.append(f"torch packs in_proj_weight only when kdim == vdim == embed_dim; the "
                     f"layer has embed_dim={layer.embed_dim}, kdim={layer.kdim}, "
                     f"vdim={layer.vdim}")
    return (f"state_dict does not fit layout {layout!r} for {_describe(layer)}: missing "
            f"[{_some(repr(name) for name in missing)}], unexpected "
            f"[{_some(repr(name) for name in unexpected)}]" + "".join(f"; {h}" for h in hints))


def from_torch(layer: Any, state_dict: Mapping[str, Any], layout: str, *,
               prefix: str = "") -> None:
    """Load a PyTorch ``state_dict`` of ``layout`` into ``layer``, in place.

    Parameters
    ----------
    layer : SelfAttention, MultiHeadAttention or GPTModel
        Its arrays are overwritten (:meth:`qkvnp.layers.Layer.load_state_dict`):
        optimizers and models that share them see the new values.
    state_dict : mapping or torch.nn.Module
        ``torch name -> tensor or array``, e.g. ``torch_module.state_dict()``,
        or the module itself (its ``state_dict()`` is read). Cast to the
        layer's dtype, bfloat16 included, as torch's ``load_state_dict``
        casts. For ``"torch.nn.MultiheadAttention"`` the input projections
        may be packed (``in_proj_weight``) or separate (``q_proj_weight``
        ...), whichever the dict has. A module shows what its state dict
        cannot: an ``nn.MultiheadAttention`` built with ``add_zero_attn=True``
        (or ``add_bias_kv=True``) is refused, and so is a module whose
        settings that the weights' shapes cannot show differ from the
        layer's: the ``num_heads`` of an attention (each block's, for
        ``"book.GPTModel"``), a LayerNorm's ``eps``, an ``nn.GELU``'s
        ``approximate``; the message names the submodule and both values.
        A plain state dict cannot show these: pass the module when you
        have it. With ``prefix``, the checks read the submodule it names.
    layout : str
        One of :data:`LAYOUTS`.
    prefix : str, keyword-only
        Load the keys that start with it, without it, and ignore the others:
        the layer's place in a larger model's ``state_dict`` (the book's GPT
        names its attention ``"trf_blocks.0.att."``; a model holding an
        ``nn.MultiheadAttention`` as ``self.attn``, ``"attn."``). A prefix
        without its trailing dot gets one (``"enc"`` is ``"enc."``).

    Returns
    -------
    None

    Raises
    ------
    ValueError
        If ``layout`` is unknown or does not fit the layer or the dict
        (missing or unexpected keys, a shape, ``bias_k``/``bias_v``, no key
        under ``prefix``); the message says what differs, and names the
        prefix when the keys carry one. For a module built with
        ``add_zero_attn=True`` or ``add_bias_kv=True`` (naming the option),
        or with another ``num_heads``, ``eps`` or ``approximate`` (naming
        the submodule). Also on NaN or inf. A message names a composite by
        its class and sizes and lists a few keys, not all of them.
    TypeError
        If ``state_dict`` is neither a mapping nor a module, ``prefix`` not
        a str, or a value does not hold real numbers.
    """
    _check_layout(layer, layout)
    prefix = _check_prefix(prefix)
    if _is_module(state_dict):
        module: Any = state_dict
        _check_module(layer, layout, module, prefix)
        state_dict = module.state_dict()
    if not hasattr(state_dict, "keys") or not hasattr(state_dict, "__getitem__"):
        raise TypeError(f"state_dict must be a mapping of name -> tensor or array, or a torch "
                        f"module, got {type(state_dict).__name__}")
    if prefix:
        under = {name[len(prefix):]: state_dict[name] for name in state_dict.keys()
                 if name.startswith(prefix)}
        if not under:
            some = sorted(state_dict.keys())[:3]
            raise ValueError(f"state_dict has no key under prefix {prefix!r} (keys such as "
                             f"{some}); the prefix is the layer's name in the model")
        state_dict = under
    given = {name for name in state_dict if not _is_book_mask(name, layout)}
    if layout == "torch.nn.MultiheadAttention":
        kv = sorted(given & {"bias_k", "bias_v"})
        if kv:
            raise ValueError(f"state_dict has {kv}: nn.MultiheadAttention(add_bias_kv=True) "
                             "appends a learned key and value to every sequence, which qkvnp "
                             "does not support")
    expected = to_torch(layer, layout)  # names and shapes; also the layer's current values
    if layout == "torch.nn.MultiheadAttention" and "in_proj_weight" not in given and \
            "in_proj_weight" in expected:  # separate q/k/v_proj_weight for a square layer
        E = layer.embed_dim
        expected.pop("in_proj_weight")
        expected.update({f"{r[0]}_proj_weight": np.empty((E, E)) for r in _ROLES})
    missing, unexpected = set(expected) - given, given - set(expected)
    if missing or unexpected:
        hint = None if prefix else _prefix_hint(layout, unexpected, expected)
        if hint is not None:  # the likeliest cause: the other hints would mislead
            raise ValueError(f"state_dict does not fit layout {layout!r} for {_describe(layer)}: "
                             f"{hint} (missing [{_some(repr(name) for name in missing)}], "
                             f"unexpected [{_some(repr(name) for name in unexpected)}])")
        raise ValueError(_missing_message(layout, layer, missing, unexpected))
    values = {}
    for name, target in expected.items():
        values[name] = check_state_value(state_dict[name], f"state_dict[{name!r}]",
                                         target.shape, layer.dtype,
                                         f" for {_describe(layer)} (layout {layout!r})")
    if layout == "book.GPTModel":
        layer.load_state_dict(_gpt_to_qkvnp(layer, values))
    else:
        layer.load_state_dict(_to_qkvnp(layer, layout, values))


def _is_book_mask(name, layout):
    """The book's causal ``mask`` buffer (a layer's, or each GPT block's attention's)."""
    if layout == "book.GPTModel":
        parts = name.split(".")
        return len(parts) == 4 and parts[0] == "trf_blocks" and parts[2:] == ["att", "mask"]
    return name == "mask" and layout.startswith("book.")


def _gpt_to_torch(model):
    """A :class:`GPTModel`'s parameters under the book's ``GPTModel.state_dict()`` names."""
    p = model.params
    state = {"tok_emb.weight": p["tok_emb.weight"], "pos_emb.weight": p["pos_emb.weight"]}
    for i, block in enumerate(model.trf_blocks):
        state.update(to_torch(block.att, "book.MultiHeadAttention", prefix=f"trf_blocks.{i}.att."))
        for name in ("ff.layers.0", "ff.layers.2"):
            weight = p[f"trf_blocks.{i}.{name}.W"].T  # (in, out) -> (out, in)
            state[f"trf_blocks.{i}.{name}.weight"] = weight
            state[f"trf_blocks.{i}.{name}.bias"] = p[f"trf_blocks.{i}.{name}.b"]
        for name in ("norm1", "norm2"):
            for part in ("scale", "shift"):
                state[f"trf_blocks.{i}.{name}.{part}"] = p[f"trf_blocks.{i}.{name}.{part}"]
    state["final_norm.scale"] = p["final_norm.scale"]
    state["final_norm.shift"] = p["final_norm.shift"]
    # NOTE: a tied head is the token table itself, under the head's name too
    state["out_head.weight"] = (p["tok_emb.weight"] if model.tie_embeddings
                                else p["out_head.W"].T)  # (E, V) -> (V, E)
    return {name: np.array(value, order="C") for name, value in state.items()}


def _gpt_to_qkvnp(model, values):
    """The book-named, checked ``values`` under :class:`GPTModel`'s parameter names."""
    if model.tie_embeddings:
        if not np.array_equal(values["out_head.weight"], values["tok_emb.weight"]):
            raise ValueError("state_dict['out_head.weight'] differs from "
                             "state_dict['tok_emb.weight'], but the model ties its head to the "
                             "token table (tie_embeddings=True); load it into a model built "
                             "with tie_embeddings=False")
        values = {name: value for name, value in values.items() if name != "out_head.weight"}
    params = {}
    for name, value in values.items():
        parts = name.split(".")
        if parts[0] == "trf_blocks" and parts[2] == "att":
            continue  # below, by the attention layout
        if parts[-1] == "weight" and (parts[0] == "out_head" or "layers" in parts):
            params[".".join(parts[:-1]) + ".W"] = value.T  # (out, in) -> (in, out)
        elif parts[-1] == "bias":
            params[".".join(parts[:-1]) + ".b"] = value
        else:
            params[name] = value  # embeddings' weight, norms' scale and shift
    for i, block in enumerate(model.trf_blocks):
        prefix = f"trf_blocks.{i}.att."
        att = {name[len(prefix):]: value for name, value in values.items()
               if name.startswith(prefix)}
        params.update({prefix + name: value
                       for name, value in _to_qkvnp(block.att, "book.MultiHeadAttention",
                                                    att).items()})
    return params


def _to_qkvnp(layer, layout, values):
    """The torch-named, checked ``values`` under qkvnp's names and ``x @ W`` layout."""
    if layout == "book.SelfAttention_v1":
        return {f"W_{role}": values[f"W_{role}"] for role in _ROLES}
    params = {}
    if layout == "torch.nn.MultiheadAttention":
        E = layer.embed_dim
        for i, role in enumerate(_ROLES):
            if "in_proj_weight" in values:
                params[f"W_{role}"] = values["in_proj_weight"][i * E:(i + 1) * E].T  # (E, E)
            else:
                params[f"W_{role}"] = values[f"{role[0]}_proj_weight"].T  # (E, in) -> (in, E)
            if "in_proj_bias" in values:
                params[f"b_{role}"] = values["in_proj_bias"][i * E:(i + 1) * E]
    else:
        for role in _ROLES:
            params[f"W_{role}"] = values[f"W_{role}.weight"].T  # (E, in) -> (in, E)
            if f"W_{role}.bias" in values:
                params[f"b_{role}"] = values[f"W_{role}.bias"]
    if "out_proj.weight" in values:
        params["W_out"] = values["out_proj.weight"].T  # (out, E) -> (E, out)
    if "out_proj.bias" in values:
        params["b_out"] = values["out_proj.bias"]
    return params
