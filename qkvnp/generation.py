"""Text generation with a :class:`~qkvnp.GPTModel`: the book's chapter 5 ``generate``.

Shape key: B batch, T tokens of the context, V vocabulary.

Decoding runs through one :class:`~qkvnp.KVCache` per block: the prompt is
fed once, then each new token alone, attending to the cached keys and
values. The tokens are those of recomputing the whole (cropped) context at
every step, as the book's loop does.
"""
from __future__ import annotations


import numpy as np

from ._checks import check_int, is_real_number, make_rng
from .kv_cache import KVCache

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any
    from ._typing import FloatArray, IntArray

__all__ = ["generate"]


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


def _next_tokens(logits, temperature, top_k, rng):
    """The book's choice: top-k filter, then argmax (temperature 0) or a sample."""
    if top_k is not None:
        kth = np.sort(logits, axis=-1)[:, -top_k][:, None]  # (B, 1) the k-th largest
        logits = np.where(logits < kth, -np.inf, logits)  # (B, V)
    if temperature == 0.0:
        return logits.argmax(axis=-1)  # (B,) first maximum, as torch.argmax
    scaled = logits / temperature
    scaled = scaled - scaled.max(axis=-1, keepdims=True)
    probs = np.exp(scaled)
    probs /= probs.sum(axis=-1, keepdims=True)  # (B, V)
    # NOTE: inverse CDF with one uniform per row: the draws of a seeded rng
    # are those of the same call recomputing the context (not torch.multinomial's)
    u = rng.random(probs.shape[0])[:, None]  # (B, 1)
    cdf = np.cumsum(probs, axis=-1)  # (B, V)
    return np.minimum((cdf <= u * cdf[:, -1:]).sum(axis=-1), probs.shape[-1] - 1)


def generate(model: Any, idx: IntArray, max_new_tokens: int, *, context_size: int | None = None,
             temperature: float = 0.0, top_k: int | None = None,
             rng: np.random.Generator | int | None = None, eos_id: int | None = None,
             use_cache: bool = True,
             return_logits: bool = False) -> IntArray | tuple[IntArray, FloatArray]:
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
        ``softmax(logits / temperature)``.
    top_k : int, keyword-only, optional
        Keep the ``top_k`` largest logits (ties with the k-th kept), the
        others get ``-inf``.
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

    Returns
    -------
    idx : ndarray of int64, shape (B, T + n)
        The prompt and the ``n <= max_new_tokens`` new tokens.
    logits : ndarray, shape (B, n, V)
        Only with ``return_logits``; the logits each token was chosen from,
        before top-k and temperature.

    Raises
    ------
    ValueError, TypeError
        On a bad argument (the message names it).

    Notes
    -----
    No dropout: decoding is inference (``model.backward`` then raises until
    the next ``forward``). With the cache, each step costs one token's
    projections and an attention row over the cached keys.

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
    rng = make_rng(rng)
    caches = [KVCache() for _ in range(model.num_layers)]
    chosen_logits = []
    pending = None  # tokens not yet fed to the caches
    for _ in range(max_new_tokens):
        window = idx[:, -context_size:]  # (B, <= context_size)
        position = caches[0].start + len(caches[0])  # of the next token (a window drops some)
        if not use_cache or pending is None or position + 1 > context_size:
            for cache in caches:  # a first step, no cache, or a slid window: from scratch
                cache.reset()
            logits = model.decode(window, caches)[:, -1]  # (B, T, V) -> (B, V)
        else:
            logits = model.decode(pending, caches)[:, -1]  # (B, 1) -> (B, V)
        next_tokens = _next_tokens(logits, temperature, top_k, rng)  # (B,)
        if eos_id is not None and (next_tokens == eos_id).all():
            break
        chosen_logits.append(logits)
        idx = np.concatenate([idx, next_tokens[:, None]], axis=1)  # (B, T) -> (B, T + 1)
        pending = next_tokens[:, None]  # (B, 1)
    if not return_logits:
        return idx
    V = model.vocab_size
    logits = np.stack(chosen_logits, axis=1) if chosen_logits else np.empty((idx.shape[0], 0, V))
    return idx, logits
