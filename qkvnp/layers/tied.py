"""An output head that reads a token-embedding table: :class:`TiedLinear`.

Shape key: V vocabulary, E embedding.

One parameter used twice: the table ``weight (V, E)`` of an
:class:`~qkvnp.Embedding` is also the head's matrix, ``z = x weight^T``
(GPT-2's ``lm_head`` and the weight tying of Press and Wolf). The head holds
no parameter of its own: the table stays the embedding's, once in a model's
``params``, and the head adds its gradient into the embedding's ``grads``.
"""
from __future__ import annotations

from .. import functional as F
from .._checks import as_float_array, check_last_dim, check_ndim, owned
from .base import Layer
from .basic import Embedding
from .transaction import add_grad

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import FloatArray

__all__ = ["TiedLinear"]


class TiedLinear(Layer):
    """The head ``z = x W^T`` whose matrix is an :class:`~qkvnp.Embedding`'s table, shared.

    Parameters
    ----------
    embedding : Embedding
        The table ``weight (V, E)`` that the head reads at every forward
        and whose gradient it adds to.

    Attributes
    ----------
    embedding : Embedding
    in_features, out_features : int
        ``E`` and ``V``.
    params, grads : dict
        Empty: the head owns no parameter. Its gradient goes into
        ``embedding.grads["weight"]``, beside the embedding's own.

    Notes
    -----
    Forward: :math:`Z = X W^T` with :math:`W` the table, (..., E) -> (..., V).
    Backward: :math:`\\bar X = \\bar Z W` and :math:`\\bar W \\mathrel{+}= \\bar Z^T X`
    (rows flattened), added into the embedding's gradient. A model that
    also looks tokens up in the table therefore gets the sum of both uses
    (``docs/derivations_gpt.md``, "Tied embeddings"). As :class:`~qkvnp.Linear`,
    the cache keeps a copy of the table as the forward read it.

    Examples
    --------
    >>> import numpy as np
    >>> from qkvnp.layers import Embedding
    >>> emb = Embedding(5, 3, rng=0)
    >>> head = TiedLinear(emb)
    >>> head.forward(np.ones((2, 3))).shape
    (2, 5)
    >>> head.backward(np.ones((2, 5))).shape, head.params
    ((2, 3), {})
    >>> emb.grads["weight"][0]
    array([2., 2., 2.])
    """

    _repr_fields = ("in_features", "out_features")
    supports_complex_step = True  # its op runs on complex (qkvnp.gradcheck, method="complex_step")

    def __init__(self, embedding: Embedding) -> None:
        if not isinstance(embedding, Embedding):
            raise TypeError(f"embedding must be a qkvnp Embedding, got {type(embedding).__name__}")
        self.embedding = embedding
        self.params = {}
        self._cache = None
        self.zero_grad()

    @property
    def in_features(self) -> int:
        """``E``, the table's width."""
        return self.embedding.embedding_dim

    @property
    def out_features(self) -> int:
        """``V``, the table's rows."""
        return self.embedding.num_embeddings

    def forward(self, x: FloatArray, *, check: bool = True) -> FloatArray:
        """The logits ``x @ weight.T``.

        Parameters
        ----------
        x : ndarray, shape (..., E)
        check : bool, keyword-only
            False: ``x`` is a composite's own checked array (:class:`~qkvnp.Linear`'s).

        Returns
        -------
        out : ndarray, shape (..., V)
        """
        # NOTE: a copy of the table as this forward read it (Layer: an optimizer step
        # between forward and backward changes the next forward, not this gradient)
        W = self.embedding.params["weight"].T.copy()  # (V, E) -> (E, V)
        if check:
            x_in, E = x, self.in_features
            x = as_float_array(x, "x", self.embedding.dtype)
            check_ndim(x, "x", 1, f"(..., {E})")
            check_last_dim(x, "x", E, f"(..., {E})")
            (x,) = owned((x,), (x_in,))  # the cache owns its copy of the caller's x
        out, linear_cache = F.linear_forward(x, W, None, check=False)  # (..., E) -> (..., V)
        self._cache = linear_cache
        return out

    def backward(self, dout: FloatArray, retain_cache: bool = False, *,
                 check: bool = True) -> FloatArray:
        """Add ``dW^T`` into the embedding's gradient; return ``dx``.

        Parameters
        ----------
        dout : ndarray, shape (..., V)
        retain_cache : bool
            Keep the cache for one more backward.
        check : bool, keyword-only
            False: ``dout`` is already checked.

        Returns
        -------
        dx : ndarray, shape (..., E)
        """
        linear_cache = self._need_cache()
        dx, dW, _ = F.linear_backward(dout, linear_cache, check)  # dW: (E, V)
        # NOTE: the table's second use: its gradient joins the lookup's in one array
        add_grad(self.embedding, "grads", "weight", dW.T)  # (E, V) -> (V, E)
        self._release_cache(retain_cache)
        return dx
