"""The seam where an attention layer's call is sent down a path.

Shape key: B batch (any leading dims), H heads, T query length, S key length,
E embedding, D head dim.

A layer asks :func:`layer_forward` to run its ``impl`` and gets back, whatever
the path, ``(out, weights, cache, dispatch)``; :func:`layer_backward` takes
the cache back. The choice itself is :func:`qkvnp.kernels.choose_path`'s; this
module runs it: the reference layer math (:mod:`qkvnp.layers.reference`,
:mod:`qkvnp.layers.variant_layer`) or the fused kernels of
:mod:`qkvnp.kernels.mha`.
"""
from __future__ import annotations

import math

from .._checks import owned
from ..kernels import choose_path
from ..kernels._runtime import single_threaded_blas
from ..ops.masks import check_is_causal

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any, Sequence

    import numpy as np

    from .._typing import ArrayLike, BoolArray, FloatArray
    from ..kernels import Dispatch

__all__ = ["layer_forward", "layer_backward"]


def layer_forward(params: dict[str, Any], inputs: Sequence[FloatArray], kind: str, num_heads: int,
                  mask: FloatArray | None, is_causal: bool | str, impl: str = "auto",
                  need_weights: bool = False, out_proj: bool = True,
                  originals: tuple[ArrayLike, ...] = (), *, dropout_p: float = 0.0,
                  rng: np.random.Generator | int | None = None,
                  dropout_mask: BoolArray | None = None,
                  variants: Any = None) -> tuple[FloatArray, FloatArray | None, Any, Dispatch]:
    """Run an attention layer's forward on the path :func:`choose_path` picks.

    Parameters
    ----------
    params : dict
        The layer's parameters (``W_query, W_key, W_value``, optional
        ``b_*``, and with ``out_proj`` ``W_out`` and optional ``b_out``).
    inputs : tuple of ndarray
        ``(x,)`` for ``kind="self"``, ``(query, key)`` for ``"key_only"``
        (value = key), ``(query, key, value)`` for ``"cross"``; already cast
        to the parameters' dtype and shape-checked by the layer.
    kind : {"self", "key_only", "cross"}
    num_heads : int
    mask : ndarray or None
        bool (True = may attend) or float (added to the scores).
    is_causal : bool or "bottom_right"
    impl : {"auto", "reference", "fast", "tiled"}
    need_weights : bool
        Also return the attention weights.
    out_proj : bool
        False for :class:`qkvnp.SelfAttention` (one head, no head axis, no
        output projection).
    originals : tuple of array_like
        The caller's own arrays behind ``inputs``: an input that may share
        memory with one of them is copied before the fused kernels keep it
        (the reference ops copy theirs themselves), so that the caller may
        edit its arrays after the forward without changing the gradients.
    dropout_p, rng, dropout_mask
        Dropout on the attention weights (``qkvnp/ops/dropout.py``); every path
        has it, and the same ``rng`` state draws the same mask on each.
    variants : qkvnp.layers.variant_layer.VariantOptions, optional
        The layer's attention variants (RoPE, position bias, sinks,
        soft-cap, window); they run on :mod:`qkvnp.layers.variant_layer`.

    Returns
    -------
    out : ndarray, shape (..., T, out_dim)
    weights : ndarray or None
    cache : ReferenceLayerCache, FusedLayerCache or SplitLayerCache
        For :func:`layer_backward`.
    dispatch : Dispatch

    Notes
    -----
    Every path writes only into memory this call owns (fresh arrays, or a
    buffer of the pool of :func:`qkvnp.kernels.buffers.recycled_empty` that
    no array refers to), and its cache keeps copies of the weights it read:
    a refused call, another thread's call or a parameter edited before the
    backward changes no cache (:class:`qkvnp.layers.Layer`).
    """
    T, S = inputs[0].shape[-2], inputs[-1].shape[-2]
    groups = math.prod(inputs[0].shape[:-2]) * (num_heads if out_proj else 1)
    path_args = (impl, groups, T, S, params["W_query"].dtype, need_weights)
    causal = check_is_causal(is_causal) is not False
    if variants is not None:
        from . import variant_layer

        names = variant_layer.active_variants(variants)
        if names:
            dispatch = choose_path(*path_args, is_causal=causal, variants=names)
            # NOTE: BLAS on one thread, as the fused paths: OpenBLAS's threads
            # made a layer with rope=True an order of magnitude slower on a
            # loaded host (benchmarks/NOTES.md)
            with single_threaded_blas():
                out, weights, cache = variant_layer.split_forward(
                    params, inputs, kind, num_heads, mask, is_causal, variants,
                    need_weights=need_weights, dropout_p=dropout_p, rng=rng,
                    dropout_mask=dropout_mask, path=dispatch.path, out_proj=out_proj)
            return out, weights, cache, dispatch
    dispatch = choose_path(*path_args, is_causal=causal)
    mha, reference = _layer_kernels()
    dropout = {"dropout_p": dropout_p, "rng": rng, "dropout_mask": dropout_mask}
    if dispatch.path != "reference":
        fused_inputs = owned(inputs, originals)
        try:
            with single_threaded_blas():  # one setting for the whole call, not one per matmul
                out, weights, cache = mha.forward(params, fused_inputs, kind, num_heads, mask,
                                                  is_causal, path=dispatch.path,
                                                  need_weights=need_weights, out_proj=out_proj,
                                                  **dropout)
            return out, weights, cache, dispatch
        except mha.ScoresMayOverflow as overflow:
            # the projections bound the scores beyond what the fused paths
            # keep exact: choose_path sends such scores to the reference
            dispatch = choose_path(*path_args, score_bound=overflow.bound, is_causal=causal,
                                   value_bound=overflow.value_bound)
            if overflow.dropout_mask is not None:  # drawn by the batch split: apply that one
                dropout["dropout_mask"] = overflow.dropout_mask
    out, weights, cache = reference.forward(params, inputs, kind, num_heads, mask, is_causal,
                                            need_weights=need_weights, out_proj=out_proj,
                                            **dropout)
    return out, weights, cache, dispatch


_LAYER_KERNELS: list[Any] = []  # [mha, reference] once imported


def _layer_kernels():
    """The layer kernels' modules, imported at the first layer call.

    NOTE: ``import qkvnp`` stays light (numpy and little else): importing the
    three kernels and their helpers cost half of ``import qkvnp``.
    """
    if not _LAYER_KERNELS:
        from . import reference
        from ..kernels import mha

        _LAYER_KERNELS[:] = [mha, reference]
    return _LAYER_KERNELS


def layer_backward(dout: FloatArray, cache: Any) -> tuple[dict[str, Any], Sequence[FloatArray]]:
    """Backward of :func:`layer_forward` on the path its forward ran.

    Returns
    -------
    grads : dict
        Gradient of each parameter the forward used.
    dinputs : tuple of ndarray
        Gradient of each entry of the forward's ``inputs``.
    """
    mha, reference = _layer_kernels()
    if isinstance(cache, reference.ReferenceLayerCache):
        return reference.backward(dout, cache)
    from . import variant_layer  # imported with the first variant layer's forward

    if isinstance(cache, (variant_layer.VariantLayerCache, variant_layer.SplitVariantCache)):
        with single_threaded_blas():
            return variant_layer.backward(dout, cache)
    with single_threaded_blas():
        return mha.backward(dout, cache)
