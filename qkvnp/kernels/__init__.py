"""The attention kernels (speed only), and the one place that picks which path runs.

Shape key: B batch (any leading dims), H heads, T query length, S key length,
E embedding, D head dim.

Three paths compute the same layers, up to rounding (:data:`PATH_TOLERANCES`):

=============  ============================================================
``reference``  :mod:`qkvnp.layers.reference`: the ops of
               :mod:`qkvnp.functional` line for line; the oracle.
``fast``       :mod:`qkvnp.kernels.mha` on the dense core of
               :mod:`qkvnp.kernels.fast`: fused projections, in-place
               softmax, worker threads (:mod:`qkvnp.kernels.mha_small`
               for a self-attention layer that runs on one thread).
``tiled``      :mod:`qkvnp.kernels.mha` on the core of
               :mod:`qkvnp.kernels.tiled`: FlashAttention-style blocks,
               memory linear in length, never the ``(T, S)`` weights.
=============  ============================================================

:func:`choose_path` is the only code that decides a path: ``impl="auto"``
and the fallback of a request a path cannot serve (weights from the tiled
path) both happen there, and its :class:`Dispatch` says why, as PyTorch's
``why_not_fast_path`` does. A layer's call goes through
:func:`qkvnp.layers.dispatch.layer_forward`, which asks it, and keeps the
last one as ``layer.last_dispatch``.

The runtime settings (worker threads, block sizes) are
:func:`set_num_threads`, :func:`set_block_sizes` and their kin from
:mod:`qkvnp.kernels._runtime`; the worker threads themselves (pinned, the
caller running a share) are :mod:`qkvnp.kernels.workers`.
"""
from __future__ import annotations

import functools
from collections import namedtuple

import numpy as np

from .._checks import scores_may_overflow
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
    "choose_decode_path",
    "choose_train_path",
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
reason : one sentence that opens with the path, e.g. ``"tiled: auto: 4096 keys >= tiled_min_length 4096"``.
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
        ``qkvnp.layers.variant_layer.active_variants``). The tiled path
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
    it computes overflowing products exactly (:mod:`qkvnp.ops.overflow`), and
    the others would return inf or NaN where it is finite. Dropout
    does not enter the choice: every path has it, and draws the same mask
    from the same Generator state (``qkvnp/ops/dropout.py``). Nor do grouped-query
    attention and both causal alignments: every path runs them.

    Examples
    --------
    >>> choose_path("auto", groups=8, T=16, S=16, dtype=np.float32).path
    'fast'
    >>> choose_path("tiled", 8, 16, 16, np.float32, need_weights=True).reason
    'fast: tiled cannot return the attention weights (it never builds them): fell back to the fast core'
    """
    impl = check_impl(impl)
    if variants:
        dispatch = _choose_variants(impl, tuple(variants), groups, T, S, np.dtype(dtype),
                                    bool(need_weights), max(score_bound, value_bound))
    elif impl != "reference" and scores_may_overflow(score_bound, dtype):
        dispatch = Dispatch(impl, "reference", f"scores may reach {score_bound:.3g}, beyond "
                                               f"sqrt(finfo({np.dtype(dtype).name}).max): only "
                                               "the reference path stays exact there")
    elif impl != "reference" and scores_may_overflow(value_bound, dtype):
        dispatch = Dispatch(impl, "reference", f"values reach {value_bound:.3g}, beyond "
                                               f"sqrt(finfo({np.dtype(dtype).name}).max): only "
                                               "the reference path stays exact there")
    else:
        sizes = get_block_sizes()  # arguments of the cached choice
        dispatch = _choose(impl, groups, T, S, np.dtype(dtype), bool(need_weights),
                           bool(is_causal), sizes["tiled_min_length"],
                           sizes["causal_tiled_min_length"], sizes["dense_weights_budget"])
    # NOTE: the reason opens with the path that ran, so that it reads alone
    return dispatch._replace(reason=f"{dispatch.path}: {dispatch.reason}")


@functools.lru_cache(maxsize=256)
def _choose(impl, groups, T, S, dtype, need_weights, is_causal, min_length, causal_min_length,
            budget):
    """:func:`choose_path` below the overflow test, cached: a layer asks the same on every call.

    A pure function of its arguments, the settings among them (its sentences
    cost more to format than the choice).
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
TILED_VARIANTS = ("rope", "position_bias='alibi'", "sinks", "softcap", "window", "scale")


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


def choose_decode_path(placement: str, norm: str, mlp: str, softcap: float | None,
                       dtype: DTypeLike, keep: Any, plain_projections: bool = True,
                       gated: bool = True) -> Dispatch:
    """The path of a decoder block's decoding step, and why.

    ``"fast"`` (``qkvnp.kernels.decode.decode_block_fast``) for a
    ``"pre"`` block of RMSNorms or LayerNorms (``norm`` ``"rms"`` or
    ``"layer"``) and a gated MLP (``gated``; activation ``mlp`` ``"silu"``
    or ``"gelu_tanh"``) or the plain MLP of GPT-2 (``gated=False``;
    ``"gelu_tanh"`` only: the exact ``"gelu"`` is not there), without an
    attention soft-cap, in a real float dtype, when every query row of
    ``keep`` ``(B, 1, T, S)`` sees a key and the projections are plain
    ``Linear`` layers (``plain_projections``: a LoRA adapter runs its own
    forward); otherwise ``"reference"`` (the layers' own calls), the first
    reason named.

    Examples
    --------
    >>> keep = np.ones((1, 1, 1, 3), bool)
    >>> choose_decode_path("pre", "rms", "silu", None, np.float32, keep).path
    'fast'
    >>> choose_decode_path("pre", "layer", "gelu_tanh", None, np.float32, keep, gated=False).reason
    'fast: a pre-norm block of LayerNorms and the plain tanh-GELU MLP'
    >>> choose_decode_path("pre", "layer", "gelu", None, np.float32, keep, gated=False).reason
    "reference: the fast step's plain MLP runs the tanh GELU, not 'gelu'"
    >>> choose_decode_path("sandwich", "rms", "silu", None, np.float32, keep).reason
    "reference: the fast step runs 'pre' blocks, not 'sandwich'"
    """
    norms = {"rms": "RMSNorms", "layer": "LayerNorms"}
    why = None
    if placement != "pre":
        why = f"the fast step runs 'pre' blocks, not {placement!r}"
    elif norm not in norms:
        why = f"the fast step runs RMSNorm or LayerNorm, not {norm!r}"
    elif gated and mlp not in ("silu", "gelu_tanh"):
        why = f"the fast step runs a gated MLP of 'silu' or 'gelu_tanh' or GPT-2's plain one, " \
              f"not {mlp!r}"
    elif not gated and mlp != "gelu_tanh":
        why = f"the fast step's plain MLP runs the tanh GELU, not {mlp!r}"
    elif softcap is not None:
        why = "the fast step has no attention soft-cap"
    elif not plain_projections:
        why = "a projection is not a plain Linear (an adapter runs its own forward)"
    elif np.dtype(dtype).kind != "f":
        why = f"the fast step runs real floats, not {np.dtype(dtype).name}"
    elif not np.asarray(keep).any(axis=-1).all():
        why = "a query row sees no key (padding): the reference defines its output"
    if why is None:
        kind = "a gated MLP" if gated else "the plain tanh-GELU MLP"
        return Dispatch("auto", "fast", f"fast: a pre-norm block of {norms[norm]} and {kind}")
    return Dispatch("auto", "reference", "reference: " + why)


def choose_train_path(block_specs: Sequence[Any], dtype: DTypeLike, keeps: Sequence[Any],
                      core_paths: Sequence[str]) -> Dispatch:
    """The path of a decoder's blocks in training (forward and backward), and why.

    ``"fused"`` (``qkvnp.kernels.decoder_train``: joined projections, the
    batch split over the worker threads) when every block's spec is a dict
    (``DecoderBlock.train_spec``: a ``"pre"`` block of RMSNorms, a gated
    MLP, no soft-cap, plain bias-free projections; otherwise the reason as a
    string), the dtype is float32, every query row of each ``keeps`` mask
    sees a key and the attention core of each block would run ``"fast"``
    (``core_paths``, :func:`choose_path`'s); otherwise ``"reference"`` (the
    layers' own calls), the first reason named.

    NOTE: float32 only: the float64 decoder is the oracle of the parity tests
    (measured reason: benchmarks/NOTES.md, "The Qwen3-like decoder").

    Examples
    --------
    >>> choose_train_path(["a 'post' block"], np.float32, [True], ["fast"]).reason
    "reference: a 'post' block"
    """
    why = next((spec for spec in block_specs if isinstance(spec, str)), None)
    if why is None and np.dtype(dtype) != np.float32:
        why = f"the fused blocks run float32, not {np.dtype(dtype).name}"
    elif why is None and any(path != "fast" for path in core_paths):
        why = "an attention core would not run the fast path"
    elif why is None and not all(np.asarray(keep).any(axis=-1).all() for keep in keeps):
        why = "a query row sees no key (padding): the reference defines its output"
    if why is None:
        return Dispatch("auto", "fused", "fused: pre-norm RMSNorm blocks with gated MLPs")
    return Dispatch("auto", "reference", "reference: " + why)
