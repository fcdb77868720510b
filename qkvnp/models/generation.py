"""Text generation with a :class:`~qkvnp.GPTModel`: the book's chapter 5 ``generate``.

Shape key: B batch, T tokens of the context, V vocabulary.

Decoding runs through one :class:`~qkvnp.KVCache` per block: the prompt is
fed once, then each new token alone, attending to the cached keys and
values. The tokens are those of recomputing the whole (cropped) context at
every step, as the book's loop does.
"""
from __future__ import annotations


import numpy as np

from .._checks import check_int, is_real_number, make_rng
from ..layers.kv_cache import KVCache

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any, Callable
    from .._typing import FloatArray, IntArray

__all__ = ["generate"]


def _check_top_p(top_p):
    if top_p is None:
        return None
    if not is_real_number(top_p) or not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p must be a float in (0, 1] (nucleus sampling: keep the likeliest "
                         f"tokens whose probabilities sum to top_p), got {top_p!r}")
    return float(top_p)


def _check_options(model, idx, max_new_tokens, context_size, temperature, top_k, eos_id):
    idx = np.asarray(idx)
    if idx.dtype.kind not in "iu" or idx.ndim != 2 or idx.shape[1] < 1:
        raise ValueError(f"idx must be integer token ids of shape (B, T) with T >= 1, got "
                         f"dtype {idx.dtype} and shape {idx.shape}")
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens", 0)
    limit = model.context_length
    context_size = limit if context_size is None else check_int(
        context_size, "context_size", 1, limit, expected=f"in [1, context_length={limit}]")
    if not is_real_number(temperature) or not 0.0 <= float(temperature) < np.inf:
        raise ValueError(f"temperature must be a finite float >= 0 (0 = greedy), got "
                         f"{temperature!r}")
    if top_k is not None:
        top_k = check_int(top_k, "top_k", 1, model.vocab_size,
                          expected=f"in [1, vocab_size={model.vocab_size}]")
    if eos_id is not None:
        eos_id = check_int(eos_id, "eos_id", 0, model.vocab_size - 1)
    return idx.astype(np.int64), max_new_tokens, context_size, float(temperature), top_k, eos_id


def _nucleus(probs, top_p):  # (B, V) -> (B, V)
    """``probs`` kept on the smallest set of the likeliest tokens holding ``top_p`` of the
    mass, ties with the last one kept (as top-k keeps the k-th's), renormalised."""
    ordered = -np.sort(-probs, axis=-1)  # (B, V) descending
    mass = np.cumsum(ordered, axis=-1)  # (B, V)
    # NOTE: against top_p times the row's own sum, so that rounding never leaves a row short
    last = (mass < top_p * mass[:, -1:]).sum(axis=-1)  # (B,) index of the last token kept
    threshold = ordered[np.arange(len(probs)), np.minimum(last, probs.shape[-1] - 1)]  # (B,)
    kept = np.where(probs >= threshold[:, None], probs, 0.0)  # (B, V)
    return kept / kept.sum(axis=-1, keepdims=True)


def _next_tokens(logits, temperature, top_k, rng, top_p=None):  # (B, V) -> (B,)
    """The book's choice: top-k filter, then argmax (temperature 0) or a sample (of the
    nucleus with ``top_p``)."""
    top = logits.max(axis=-1, keepdims=True)  # (B, 1)
    if not np.isfinite(top).all():
        raise ValueError(f"the model's logits must have a finite maximum in every row (NaN, "
                         f"+inf or a row of -inf is no distribution), got row maxima "
                         f"{top[:, 0].tolist()[:4]}")
    if top_k is not None:
        kth = np.sort(logits, axis=-1)[:, -top_k][:, None]  # (B, 1) the k-th largest
        logits = np.where(logits < kth, -np.inf, logits)  # (B, V)
    if temperature == 0.0:
        return logits.argmax(axis=-1)  # (B,) first maximum, as torch.argmax
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        scaled = logits / temperature  # (B, V) in the logits' dtype; top-k's -inf stay -inf
        scaled_top = scaled.max(axis=-1, keepdims=True)  # (B, 1)
        scaled = scaled - scaled_top  # exp below is at most 1
    # NOTE: where logits / temperature overflow, or the temperature rounds to 0
    # in the logits' dtype (1e-320 in float32), the gaps to the maximum are
    # worth over 1e30 temperatures (unless the logits are subnormal): softmax
    # is then its limit, 1 on the maxima and 0 elsewhere, not inf - inf = NaN
    overflowed = ~np.isfinite(scaled_top[:, 0])  # (B,)
    scaled[overflowed] = np.where(logits[overflowed] == top[overflowed], 0.0, -np.inf)
    probs = np.exp(scaled)
    probs /= probs.sum(axis=-1, keepdims=True)  # (B, V)
    if top_p is not None:
        probs = _nucleus(probs, top_p)  # (B, V)
    # NOTE: inverse CDF with one uniform per row: the draws of a seeded rng
    # are those of the same call recomputing the context (not torch.multinomial's)
    u = rng.random(probs.shape[0])[:, None]  # (B, 1)
    cdf = np.cumsum(probs, axis=-1)  # (B, V)
    return np.minimum((cdf <= u * cdf[:, -1:]).sum(axis=-1), probs.shape[-1] - 1)


def _check_mask(model, attention_mask, shape):
    """``attention_mask`` (B, T) of 0/1 as bool, or None; refused for a model without padding."""
    if attention_mask is None:
        return None
    if not getattr(model, "supports_padding", False):
        raise TypeError(f"attention_mask needs a model that takes padding (qkvnp.Decoder), got "
                        f"{type(model).__name__}")
    mask = np.asarray(attention_mask)
    if mask.shape != shape or mask.dtype.kind not in "biu" or not np.isin(mask, (0, 1)).all():
        raise ValueError(f"attention_mask must hold 0 and 1 in the prompt's shape {shape}, got "
                         f"dtype {mask.dtype} and shape {mask.shape}")
    if not mask.any(axis=1).all():
        raise ValueError("attention_mask must keep at least one token of every prompt")
    return mask.astype(bool)


def _padded_inputs(mask, first, end, T):
    """The mask of ``[first, end)`` and the positions of its last ``T`` tokens, as
    transformers' generate counts them: ``cumsum(mask) - 1`` over the window, padding at 1."""
    window = mask[:, first:end]  # (B, end - first)
    positions = np.cumsum(window, axis=1) - 1  # (B, end - first)
    positions[~window] = 1
    return window.astype(np.int64), positions[:, -T:]


def _last_logits(model, caches, tokens, end, context_size, fresh, mask):  # -> (B, V)
    """The logits after ``tokens[:, :end]``: the cropped window from empty caches
    (``fresh``), or the last token alone on the caches holding the ones before it."""
    if fresh:  # a first step, no cache, or a slid window: from scratch
        for cache in caches:
            cache.reset()
        window = tokens[:, max(0, end - context_size):end]  # (B, <= context_size)
    else:
        window = tokens[:, end - 1:end]  # (B, 1)
    if mask is None:
        return model.decode(window, caches)[:, -1]  # (B, T, V) -> (B, V)
    first = end - window.shape[1] - caches[0].start - len(caches[0])  # the caches' first token
    seen, positions = _padded_inputs(mask, first, end, window.shape[1])
    return model.decode(window, caches, attention_mask=seen, position_ids=positions)[:, -1]


def generate(model: Any, idx: IntArray, max_new_tokens: int, *, context_size: int | None = None,
             temperature: float = 0.0, top_k: int | None = None,
             rng: np.random.Generator | int | None = None, eos_id: int | None = None,
             use_cache: bool = True, return_logits: bool = False,
             attention_mask: Any = None, top_p: float | None = None,
             on_token: Callable[[IntArray], Any] | None = None,
             ) -> IntArray | tuple[IntArray, FloatArray]:
    """Extend ``idx`` by up to ``max_new_tokens`` tokens (the book's ``generate``).

    Parameters
    ----------
    model : GPTModel
    idx : ndarray of int, shape (B, T)
        The prompt.
    max_new_tokens : int
    context_size : int, keyword-only, optional
        The model sees the last ``context_size`` tokens (default and at most
        ``model.context_length``), as the book's ``idx[:, -context_size:]``.
    temperature : float, keyword-only
        0 (default): greedy, the argmax. Above 0: sample from
        ``softmax(logits / temperature)`` (in the logits' dtype). A
        temperature so small that ``logits / temperature`` overflows, or
        rounds to 0 in that dtype (``1e-320``), is handled, not refused:
        it samples the limit, uniformly among the tied maxima (the argmax
        when there is one), never NaN.
    top_k : int, keyword-only, optional
        Keep the ``top_k`` largest logits (ties with the k-th kept), the
        others get ``-inf``.
    top_p : float in (0, 1], keyword-only, optional
        Nucleus sampling (Holtzman et al.): after top-k and the
        temperature, sample only among the smallest set of the likeliest
        tokens whose probabilities sum to at least ``top_p``, tokens tied
        with the last one kept (as top-k keeps ties), renormalised. No
        effect on greedy decoding (the argmax is always kept); ``1.0``
        keeps every token of non-zero probability.
    rng : numpy.random.Generator or int, keyword-only, optional
        Draws the samples (one uniform per row and step).
    eos_id : int, keyword-only, optional
        Stop when every row's next token is ``eos_id`` (not appended), as the
        book's ``if idx_next == eos_id: break`` for one row.
    use_cache : bool, keyword-only
        Decode through one :class:`~qkvnp.KVCache` per block (default), or
        recompute the cropped context at every step.
    return_logits : bool, keyword-only
        Also return the logits of each step's last position.
    attention_mask : ndarray of 0/1, shape (B, T), keyword-only, optional
        A batch of prompts of different lengths, padded (left, as
        transformers' ``generate`` expects; 0 marks padding): the padding is
        never attended to, and each token's position counts only the real
        tokens before it (``cumsum(mask) - 1``, as transformers' generate).
        For a model that takes padding (:class:`~qkvnp.Decoder`).
    on_token : callable, keyword-only, optional
        Called with each step's new tokens, an int64 array of shape (B,), as
        soon as they are chosen (to stream text as it comes); not called for
        a step that stops at ``eos_id``.

    Returns
    -------
    idx : ndarray of int64, shape (B, T + n)
        The prompt and the ``n <= max_new_tokens`` new tokens (a new array
        holding just these).
    logits : ndarray, shape (B, n, V)
        Only with ``return_logits``; the logits each token was chosen from,
        before top-k and temperature (a new array holding just these).

    Raises
    ------
    ValueError, TypeError
        On a bad argument (the message names it). ValueError also when the
        model's logits have a row without a finite maximum (NaN, ``+inf``,
        or all ``-inf``): no distribution to sample, as ``torch.multinomial``
        refuses.

    Notes
    -----
    No dropout: decoding is inference (``model.backward`` then raises until
    the next ``forward``). With the cache, each step costs one token's
    projections and an attention row over the cached keys.

    Memory: the tokens (and, with ``return_logits``, the ``(B, V)`` logits
    of each step) go into arrays of ``max_new_tokens`` entries allocated
    once; a step's ``(B, T, V)`` output is freed by the next step. Beyond
    these and the caches (at most ``context_size`` tokens), memory does not
    grow with ``max_new_tokens``.

    NOTE: a position embedding is absolute, so once the context has
    ``context_size`` tokens the cropped window slides: every token changes
    position and the cached keys and values are stale. The cache is then
    rebuilt from the cropped window (one forward of ``context_size``
    tokens), which is what recomputing the context at every step gives:
    the tokens do not depend on ``use_cache``.

    Examples
    --------
    >>> import qkvnp
    >>> model = qkvnp.GPTModel(16, 8, 8, 2, 1, rng=0)
    >>> out = generate(model, np.array([[1, 2, 3]]), 4)
    >>> out.shape, bool((out[:, :3] == [1, 2, 3]).all())
    ((1, 7), True)
    """
    idx, max_new_tokens, context_size, temperature, top_k, eos_id = _check_options(
        model, idx, max_new_tokens, context_size, temperature, top_k, eos_id)
    top_p = _check_top_p(top_p)
    if on_token is not None and not callable(on_token):
        raise TypeError(f"on_token must be callable, got {type(on_token).__name__}")
    rng = make_rng(rng)
    (B, T), V = idx.shape, model.vocab_size
    mask = _check_mask(model, attention_mask, (B, T))
    if mask is not None:  # the new tokens are real
        mask = np.concatenate([mask, np.ones((B, max_new_tokens), bool)], axis=1)
    caches = [KVCache() for _ in range(model.num_layers)]
    # NOTE: the tokens and the chosen logits go into arrays allocated once: a
    # step keeps no reference to the model's (B, T, V) output, and no token is
    # copied twice (growing by concatenation copies the whole array each step)
    tokens = np.empty((B, T + max_new_tokens), np.int64)  # (B, T + max_new_tokens)
    tokens[:, :T] = idx
    kept = np.empty((B, max_new_tokens, V), model.dtype) if return_logits else None
    n = 0  # the new tokens so far
    while n < max_new_tokens:
        fed = caches[0].start + len(caches[0])  # tokens the caches hold (a window drops some)
        fresh = not use_cache or n == 0 or fed + 1 > context_size
        logits = _last_logits(model, caches, tokens, T + n, context_size, fresh, mask)  # (B, V)
        next_tokens = _next_tokens(logits, temperature, top_k, rng, top_p)  # (B,)
        if eos_id is not None and (next_tokens == eos_id).all():
            break
        if kept is not None:
            kept[:, n] = logits  # a copy: the (B, T, V) output it views is freed
        tokens[:, T + n] = next_tokens
        n += 1
        if on_token is not None:
            on_token(tokens[:, T + n - 1].copy())
    out = tokens if n == max_new_tokens else tokens[:, :T + n].copy()  # (B, T + n)
    if kept is None:
        return out
    return out, kept if n == max_new_tokens else kept[:, :n].copy()  # (B, n, V)
