"""The kv-recall model's attention backward, with the items' gradient left as two factors.

Shape key: B batch, T query length (1 in the model), P items (the keys and
values, ``S`` of attention), E embedding.

Replaces :func:`qkvnp.functional.attention_backward` with
``key_is_value=True`` (one array ``X`` as both key and value) where the
caller only multiplies ``dX`` further: it returns the two factors of
``dX = left^T right`` (``qkvnp.ops.attention.key_value_factors``)
instead of their product. The kv-recall model's two embedding tables each
fold their one-hot lookup onto ``left``
(:func:`qkvnp.functional.embedding_backward_factored`), so the ``(B, P, E)``
gradient is never formed. Tested against the reference in
``tests/kernels/test_kv_recall.py``.
"""
from __future__ import annotations

from ..ops.attention import key_value_factors

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from ..ops.attention import AttentionCache
    from .._typing import FloatArray

__all__ = ["items_backward_factors"]


def items_backward_factors(dout: FloatArray, cache: AttentionCache
                           ) -> tuple[FloatArray, FloatArray, FloatArray]:
    """``attention_backward(dout, cache, key_is_value=True)`` with ``dX`` as two factors.

    Parameters
    ----------
    dout : ndarray, shape (..., T, E)
        The model's own gradient, already checked and cast (as the
        backwards' ``check=False``).
    cache : AttentionCache
        Of a forward given one array ``X`` as both ``key`` and ``value``.

    Returns
    -------
    dquery : ndarray, shape of ``query``
    left : ndarray, shape (..., 2T, P)
    right : ndarray, shape (..., 2T, E)
        ``dX = sum_to_shape(swapaxes(left, -1, -2) @ right, X.shape)``.

    Raises
    ------
    ValueError
        If the forward's key and value were two arrays, or the cache is
        grouped or has a variant.

    Notes
    -----
    Unlike the reference, a product that overflows is not computed again
    with careful products: the factors are returned as computed, and an
    inf or NaN shows in the caller's product.
    """
    return key_value_factors(dout, cache)
