"""The attention kernels, and the one place that picks which one runs.

Shape key: B batch (any leading dims), H heads, T query length, S key length,
E embedding, D head dim.

Three paths compute the same layers, up to rounding (:data:`PATH_TOLERANCES`):

=============  ============================================================
``reference``  :mod:`qkvnp.kernels.reference`: the ops of
               :mod:`qkvnp.functional` line for line; the oracle.
``fast``       :mod:`qkvnp.kernels.mha` on the dense core of
               :mod:`qkvnp.kernels.fast`: fused projections, in-place
               softmax, worker threads (:mod:`qkvnp.kernels.mha_small`
               for a self-attention layer that runs on one thread).
``tiled``      :mod:`qkvnp.kernels.mha` on the core of
               :mod:`qkvnp.kernels.tiled`: FlashAttention-style blocks,
               memory linear in length, never the ``(T, S)`` weights.
=============  ============================================================

A layer asks :func:`layer_forward` to run its ``impl`` and gets back, whatever
the path, ``(out, weights, cache, dispatch)``; :func:`layer_backward` takes
the cache back. :func:`choose_path` is the only code that decides a path:
``impl="auto"`` and the fallback of a request a path cannot serve (weights
from the tiled path) both happen there, and its :class:`Dispatch` says why,
as PyTorch's ``why_not_fast_path`` does. Layers keep the last one as
``layer.last_dispatch``.

The runtime settings (worker threads, block sizes) are
:func:`set_num_threads`, :func:`set_block_sizes` and their kin from
:mod:`qkvnp.kernels._runtime`; the worker threads themselves (pinned, the
caller running a share) are :mod:`qkvnp.kernels.workers`.
"""
from __future__ import annotations

import functools
import math
from collections import namedtuple

import numpy as np

from .._checks import owned, scores_may_overflow
from ..masks import check_is_causal
from ._runtime import (BLOCK_SIZE_DEFAULTS, MAX_NUM_THREADS, blas_threads, block_sizes,
                       get_block_sizes, get_num_threads, num_threads, set_block_sizes,
                       set_num_threads, single_threaded_blas)
from .buffers import buffer_owner, held_buffer_bytes, release_buffers

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any, Sequence
    from .._typing import ArrayLike, BoolArray, DTypeLike, FloatArray

__all__ = [
    "IMPLS",
    "TILED_VARIANTS",
    "PATH_TOLERANCES",
    "Dispatch",
    "check_impl",
    "choose_path",
    "layer_forward",
    "layer_backward",
    "set_num_threads",
    "get_num_threads",
    "MAX_NUM_THREADS",
    "num_threads",
    "set_block_sizes",
    "get_block_sizes",
    "block_sizes",
    "BLOCK_SIZE_DEFAULTS",
    "blas_threads",
    "release_buffers",
    "held_buffer_bytes",
    "buffer_owner",
]

#: What a layer's ``impl=`` may be.
IMPLS = ("auto", "reference", "fast", "tiled")

#: Largest error of the fast and tiled paths against the reference, relative to
#: ``max(1, max|reference|)``, by dtype: the tests and the benchmark both check
#: every path against this table.
PATH_TOLERANCES = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}

Dispatch = namedtuple("Dispatch", "impl path reason")
Dispatch.__doc__ = """The path one forward ran, and why.

impl : the layer's ``impl`` ("auto", "reference", "fast" or "tiled").
path : the path that ran ("reference", "fast" or "tiled").
reason : one sentence, e.g. ``"auto: 4096 keys >= tiled_min_length 4096"``.
"""


def check_impl(impl: str) -> str:
    """Return ``impl`` if it is one of :data:`IMPLS`, else raise ``ValueError``."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def _mib(nbytes):
    return f"{nbytes / (1 << 20):.3g} MiB"


def choose_path(impl: str, groups: int, T: int, S: int, dtype: DTypeLike,
                need_weights: bool = False, score_bound: float = 0.0,
                is_causal: bool | str = False, value_bound: float = 0.0,
                variants: Any = ()) -> Dispatch:
    """The path a forward takes, and why: the only place a path is decided.

    Parameters
    ----------
    impl : {"auto", "reference", "fast", "tiled"}
    groups : int
        Number of ``(T, S)`` score matrices (batch size times heads).
    T, S : int
        Query and key lengths.
    dtype : numpy dtype
        The compute dtype (for the size of the dense weights).
    need_weights : bool
        The caller wants the ``(..., T, S)`` weights back.
    score_bound : float
        An upper bound of ``|score|``. The layers' fused kernels compute one
        from their projections, before their core runs
        (``qkvnp.kernels.mha.projected_score_bound``), and come back here
        with it when it is too large (``qkvnp.kernels.mha.ScoresMayOverflow``).
    is_causal : bool
        A causal mask (either alignment): the tiled core skips the blocks
        above the diagonal.
    value_bound : float
        ``max|value|``, when the fused kernels computed it
        (``qkvnp.kernels.mha.ScoresMayOverflow``).
    variants : tuple of str
        The attention variants the layer uses (``("rope", "softcap")``,
        ``qkvnp.kernels.variant_layer.active_variants``). The tiled path
        runs those of :data:`TILED_VARIANTS` (``qkvnp.kernels.tiled_variants``),
        the reference path all of them, the fast path none: a request a path
        cannot serve falls back to the reference, the variants named in the reason.

    Returns
    -------
    Dispatch

    Notes
    -----
    ``"auto"`` runs the fast dense path, or the tiled path from
    ``tiled_min_length`` keys on (``causal_tiled_min_length`` under a causal
    mask; both cores skip most of the masked triangle there), or when the dense weights of ``groups``
    ``(T, S)`` matrices would exceed ``dense_weights_budget`` bytes (both
    :func:`set_block_sizes` settings). Weights requested keep the dense path:
    the tiled path never builds them, so ``impl="tiled"`` with weights falls
    back to the fast core, and says so. Scores that may come near the float
    maximum (``score_bound >= sqrt(finfo.max)``), and values there
    (``value_bound``), take the reference path whatever ``impl`` says: only
    it computes overflowing products exactly (:mod:`qkvnp.overflow`), and
    the others would return inf or NaN where it is finite. Dropout
    does not enter the choice: every path has it, and draws the same mask
    from the same Generator state (``qkvnp/dropout.py``). Nor do grouped-query
    attention and both causal alignments: every path runs them.

    Examples
    --------
    >>> choose_path("auto", groups=8, T=16, S=16, dtype=np.float32).path
    'fast'
    >>> choose_path("tiled", 8, 16, 16, np.float32, need_weights=True).reason
    'tiled cannot return the attention weights (it never builds them): fell back to the fast core'
    """
    impl = check_impl(impl)
    if variants:
        return _choose_variants(impl, tuple(variants), groups, T, S, np.dtype(dtype),
                                bool(need_weights), max(score_bound, value_bound))
    if impl != "reference" and scores_may_overflow(score_bound, dtype):
        return Dispatch(impl, "reference", f"scores may reach {score_bound:.3g}, beyond "
                                           f"sqrt(finfo({np.dtype(dtype).name}).max): only the "
                                           "reference path stays exact there")
    if impl != "reference" and scores_may_overflow(value_bound, dtype):
        return Dispatch(impl, "reference", f"values reach {value_bound:.3g}, beyond "
                                           f"sqrt(finfo({np.dtype(dtype).name}).max): only the "
                                           "reference path stays exact there")
    sizes = get_block_sizes()  # arguments of the cached choice
    return _choose(impl, groups, T, S, np.dtype(dtype), bool(need_weights), bool(is_causal),
                   sizes["tiled_min_length"], sizes["causal_tiled_min_length"],
                   sizes["dense_weights_budget"])


@functools.lru_cache(maxsize=256)
def _choose(impl, groups, T, S, dtype, need_weights, is_causal, min_length, causal_min_length,
            budget):
    """:func:`choose_path` below the overflow test, cached: a layer asks the same on every call.

    A pure function of its arguments, the settings among them (its sentences
    cost 1 us to format, more than the choice).
    """
    if impl == "reference":
        return Dispatch(impl, "reference", "impl='reference' requested")
    if impl == "tiled":
        if need_weights:
            return Dispatch(impl, "fast", "tiled cannot return the attention weights (it never "
                                          "builds them): fell back to the fast core")
        return Dispatch(impl, "tiled", "impl='tiled' requested")
    if impl == "fast":
        return Dispatch(impl, "fast", "impl='fast' requested")
    dense_bytes = groups * T * S * dtype.itemsize
    if need_weights:
        return Dispatch(impl, "fast", "auto: weights requested, which only the dense fast "
                                      "core builds")
    if S >= min_length:
        return Dispatch(impl, "tiled", f"auto: {S} keys >= tiled_min_length {min_length}")
    if is_causal and S >= causal_min_length:
        return Dispatch(impl, "tiled", f"auto: causal, {S} keys >= causal_tiled_min_length "
                                       f"{causal_min_length}")
    if dense_bytes > budget:
        return Dispatch(impl, "tiled", f"auto: dense weights of {_mib(dense_bytes)} > "
                                       f"dense_weights_budget {_mib(budget)}")
    return Dispatch(impl, "fast", f"auto: {S} keys < tiled_min_length {min_length} and dense "
                                  f"weights of {_mib(dense_bytes)} within dense_weights_budget")


#: The layer variants the tiled path runs itself (``qkvnp.kernels.tiled_variants``).
TILED_VARIANTS = ("rope", "position_bias='alibi'", "sinks", "softcap", "window")


def _choose_variants(impl, variants, groups, T, S, dtype, need_weights, score_bound):
    """:func:`choose_path` for a layer with variants: tiled where it runs them all, else reference."""
    names = ", ".join(variants)
    if impl == "reference":
        return Dispatch(impl, "reference", "impl='reference' requested")
    missing = [name for name in variants if name not in TILED_VARIANTS]
    if missing or need_weights or scores_may_overflow(score_bound, dtype):
        why = (f"{', '.join(missing)} run on the reference path only" if missing else
               "weights requested, which the tiled path never builds" if need_weights else
               f"scores may reach {score_bound:.3g}: only the reference path clips them exactly")
        return Dispatch(impl, "reference", f"{names}: {why}; impl={impl!r} fell back to the "
                                           "reference path")
    if impl == "fast":
        return Dispatch(impl, "reference", f"{names}: the fast path has none of them; "
                                           "impl='fast' fell back to the reference path")
    if impl == "tiled":
        return Dispatch(impl, "tiled", f"impl='tiled' requested; {names} on the tiled path")
    sizes = get_block_sizes()
    dense_bytes = groups * T * S * dtype.itemsize
    if "window" in variants or S >= sizes["tiled_min_length"] or \
            dense_bytes > sizes["dense_weights_budget"]:
        return Dispatch(impl, "tiled", f"auto: {names} on the tiled path (it skips the blocks "
                                       "outside a window; no (T, S) weights)")
    return Dispatch(impl, "reference", f"auto: {names} with {S} keys < tiled_min_length "
                                       f"{sizes['tiled_min_length']}: the reference path")


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
        Dropout on the attention weights (``qkvnp/dropout.py``); every path
        has it, and the same ``rng`` state draws the same mask on each.
    variants : qkvnp.kernels.variant_layer.VariantOptions, optional
        The layer's attention variants (RoPE, position bias, sinks,
        soft-cap, window); they run on :mod:`qkvnp.kernels.variant_layer`.

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
            # made the (8, 128, 256, 8) float32 layer with rope=True 10x slower
            # on a loaded 2-core host (1244 against 83 ms fwd+bwd)
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
    three kernels and their helpers cost 11 ms of a 21 ms ``import qkvnp``.
    """
    if not _LAYER_KERNELS:
        from . import mha, reference

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
