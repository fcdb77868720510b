"""The small layers a model needs: :class:`Linear` and :class:`Embedding`.

Shape key: N input features, M output features, V vocabulary, E embedding.

Each calls its forward and backward op of :mod:`qkvnp.functional`.
"""
from __future__ import annotations

import numpy as np

from .. import functional as F
from .._checks import (as_float_array, check_bool, check_int, check_last_dim, check_ndim, layer_dtype, make_rng,
                       owned)
from .base import Layer

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import DTypeLike, FloatArray, IntArray

__all__ = ["Linear", "Embedding"]


class Linear(Layer):
    """Affine layer ``y = x @ W + b`` over the last axis (``fc``, ``nn.Linear``).

    Parameters
    ----------
    in_features : int
        ``N``, size of each input vector.
    out_features : int
        ``M``, size of each output vector.
    bias : bool
        Add ``b`` of shape ``(M,)``. Positional, as ``nn.Linear``'s; a
        non-bool raises ``TypeError``. ``rng`` and ``dtype`` are keyword-only.
    rng : numpy.random.Generator or int, optional
        Source of the initial weights.
    dtype : float dtype
        float32 or float64 (float16 is computed in float32).

    Attributes
    ----------
    params : dict
        ``W (N, M)`` (the ``x @ W`` convention; PyTorch's
        ``nn.Linear.weight`` is ``W.T``) and, with ``bias``, ``b (M,)``.
    grads : dict
        Same keys and shapes as ``params``.

    Notes
    -----
    Forward: :math:`Y = XW + b` (:func:`qkvnp.functional.linear_forward`).
    Backward, leading dims of :math:`X` flattened into rows:
    :math:`\\bar X = \\bar Y W^T`, :math:`\\bar W = X^T \\bar Y`,
    :math:`\\bar b = \\sum_{rows} \\bar Y`.

    Initialised as ``nn.Linear``: ``W``, ``b`` uniform in :math:`[-1/\\sqrt{N}, 1/\\sqrt{N}]`.

    Examples
    --------
    >>> layer = Linear(3, 2, rng=0)
    >>> layer.forward(np.ones((4, 5, 3))).shape
    (4, 5, 2)
    >>> layer.backward(np.ones((4, 5, 2))).shape
    (4, 5, 3)
    >>> layer.grads["b"]
    array([20., 20.])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 rng: np.random.Generator | int | None = None,
                 dtype: DTypeLike = np.float64) -> None:
        self.in_features = check_int(in_features, "in_features", 1)
        self.out_features = check_int(out_features, "out_features", 1)
        self.dtype = layer_dtype(dtype)
        self.bias = check_bool(bias, "bias")
        rng = make_rng(rng)
        bound = 1.0 / np.sqrt(self.in_features)
        self.params = {
            "W": rng.uniform(-bound, bound, size=(self.in_features, self.out_features)).astype(self.dtype),
        }
        if self.bias:
            self.params["b"] = rng.uniform(-bound, bound, size=self.out_features).astype(self.dtype)
        self._cache = None
        self.zero_grad()

    _repr_fields = ("in_features", "out_features", "bias", "dtype")
    supports_complex_step = True  # its op runs on complex (qkvnp.gradcheck, method="complex_step")

    def forward(self, x: FloatArray, *, check: bool = True) -> FloatArray:
        """Apply the affine map to the last axis of ``x``.

        Parameters
        ----------
        x : ndarray, shape (..., in_features)
            Cast to the layer's dtype (ints and float128 included).
        check : bool, keyword-only
            False: ``x`` is a composite model's own array, already of the
            layer's dtype and shape and finite, which it does not edit before
            the backward; neither ``x`` nor the parameters are checked, and
            ``x`` is not copied (as :func:`qkvnp.functional.linear_forward`'s
            ``check``, and :meth:`backward`'s).

        Returns
        -------
        out : ndarray, shape (..., out_features)

        Raises
        ------
        TypeError
            If ``x`` does not hold real numbers.
        ValueError
            On a shape mismatch, or NaN or inf in ``x``.
        """
        W, b = self.params["W"], self.params["b"] if self.bias else None
        if check:
            x_in = x
            x = as_float_array(x, "x", self.dtype)
            check_ndim(x, "x", 1, f"(..., {self.in_features})")
            check_last_dim(x, "x", self.in_features, f"(..., {self.in_features})")
            W = as_float_array(W, "W", self.dtype)  # finite; not a copy
            b = None if b is None else as_float_array(b, "b", self.dtype)
            # NOTE: each input checked once, here, then check=False: the op would
            # check x again on every call (a third of kv-recall's readout). The cache owns its copy of the caller's x.
            (x,) = owned((x,), (x_in,))
        # NOTE: the backward differentiates the forward as it ran (Layer): the
        # cache keeps a copy of W, not the parameter an optimizer may update
        # between the forward and the backward (b is not read by the backward)
        W = W.copy()
        out, linear_cache = F.linear_forward(x, W, b, check=False)  # (..., N) -> (..., M)
        self._cache = (linear_cache, out.shape)
        return out

    def backward(self, dout: FloatArray, retain_cache: bool = False, *,
                 check: bool = True) -> FloatArray:
        """Accumulate ``dW`` (and ``db``) into ``grads``; return ``dx``.

        Parameters
        ----------
        dout : ndarray, shape (..., out_features)
            Same shape as the forward output (not broadcast); cast to the
            layer's dtype.
        retain_cache : bool
            Keep the cache for one more backward (PyTorch's ``retain_graph``).
        check : bool, keyword-only
            False: ``dout`` is a composite model's own gradient, already
            checked; it is not checked again (the functional ops' ``check``).

        Returns
        -------
        dx : ndarray, shape (..., in_features)

        Raises
        ------
        TypeError
            If ``dout`` does not hold real numbers (complex, object...).
        ValueError
            If ``dout`` has another shape or holds NaN or inf.
        RuntimeError
            Without a forward cache to use (see :class:`~qkvnp.layers.Layer`).
        """
        linear_cache, _ = self._need_cache()
        dx, dW, db = F.linear_backward(dout, linear_cache, check)  # checks dout unless check=False
        self._accumulate("W", dW)
        if self.bias:
            self._accumulate("b", db)
        self._release_cache(retain_cache)
        return dx


class Embedding(Layer):
    """Lookup table of ``num_embeddings`` trainable vectors (``nn.Embedding``).

    Parameters
    ----------
    num_embeddings : int
        Vocabulary size (or number of positions, for learned positional embeddings).
    embedding_dim : int
        Size of each vector.
    rng : numpy.random.Generator or int, optional
        Seed or Generator of the initial weights (a new unseeded Generator if None).
    dtype : float dtype
        Floating dtype of the parameters and the computation (float32 or float64).

    Attributes
    ----------
    params : dict
        ``weight (num_embeddings, embedding_dim)``, initialised N(0, 1) as
        PyTorch's ``nn.Embedding``.
    grads : dict

    Notes
    -----
    See :func:`qkvnp.functional.embedding_forward`. ``backward`` returns None: integer indices
    are not differentiable.

    Examples
    --------
    >>> emb = Embedding(10, 4, rng=0)
    >>> emb.forward(np.array([[1, 2, 1]])).shape
    (1, 3, 4)
    >>> emb.backward(np.ones((1, 3, 4))) is None
    True
    >>> emb.grads["weight"][1]
    array([2., 2., 2., 2.])
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *,
                 rng: np.random.Generator | int | None = None,
                 dtype: DTypeLike = np.float64) -> None:
        self.num_embeddings = check_int(num_embeddings, "num_embeddings", 1)
        self.embedding_dim = check_int(embedding_dim, "embedding_dim", 1)
        self.dtype = layer_dtype(dtype)
        rng = make_rng(rng)
        self.params = {
            "weight": rng.standard_normal((self.num_embeddings, self.embedding_dim)).astype(self.dtype),
        }
        self._cache = None
        self.zero_grad()

    _repr_fields = ("num_embeddings", "embedding_dim", "dtype")
    supports_complex_step = True  # its op runs on complex (qkvnp.gradcheck, method="complex_step")

    def forward(self, indices: IntArray) -> FloatArray:
        """Return the vectors of ``indices``.

        Parameters
        ----------
        indices : ndarray of int, shape (...)
            Entries in ``[0, num_embeddings)``.

        Returns
        -------
        out : ndarray, shape (..., embedding_dim)
        """
        out, self._cache = F.embedding_forward(indices, self.params["weight"])  # (...) -> (..., dim)
        return out

    def backward(self, dout: FloatArray, retain_cache: bool = False, *,
                 check: bool = True) -> None:
        """Accumulate the gradient of ``weight`` into ``grads``; return None.

        Parameters
        ----------
        dout : ndarray, shape (..., embedding_dim)
            Same shape as the forward output (not broadcast); cast to the
            weight's dtype.
        retain_cache : bool
            Keep the cache for one more backward (PyTorch's ``retain_graph``).
        check : bool, keyword-only
            False: ``dout`` is a composite model's own gradient, already
            checked; it is not checked again (the functional ops' ``check``).

        Raises
        ------
        TypeError
            If ``dout`` does not hold real numbers (complex, object...).
        ValueError
            If ``dout`` has another shape or holds NaN or inf.
        RuntimeError
            Without a forward cache to use (see :class:`~qkvnp.layers.Layer`).
        """
        cache = self._need_cache()
        self._accumulate("weight", F.embedding_backward(dout, cache, check))
        self._release_cache(retain_cache)
        return None
