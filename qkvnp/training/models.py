"""Small models trained by :mod:`qkvnp.training.loop`: kv-recall (and partner) and the teacher's student.

Shape key: B batch, P stored key/value pairs, T sequence length, E embedding,
K key vocabulary, V value vocabulary.

Each model is a :class:`qkvnp.Model` (sub-layers register by attribute
assignment): ONE flat ``params`` dict whose
entries are the very arrays of its sub-layers (``"embed_key.weight"`` *is* ``model.embed_key.params["weight"]``),
so an optimizer built on ``model.params`` that updates arrays in place trains
the layers. ``grads`` has the same keys; ``backward`` accumulates into it and
``zero_grad()`` resets it.
"""
from __future__ import annotations


import numpy as np

from .. import functional as F
from .._checks import as_upstream_grad, layer_dtype, make_rng
from ..kernels.kv_recall import items_backward_factors
from ..layers.transaction import journal_generator
from ..ops.dropout import check_dropout_p, spawn_generator
from ..layers import Embedding, Linear, Model, MultiHeadAttention, xavier_uniform

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any, Optional
    from .._typing import DTypeLike, FloatArray, IntArray

__all__ = ["KVRecallModel", "AttentionRegressor", "VARIANTS"]

# variant -> parameter used as the (query, key, value) projection; None = identity
VARIANTS = {
    "separate": ("W_query", "W_key", "W_value"),  # three independent matrices
    "tied_qk": ("W_qk", "W_qk", "W_value"),  # Q = K: one matrix for both
    "no_value": ("W_query", "W_key", None),  # value = the token itself
    "shared": ("W_shared", "W_shared", "W_shared"),  # one matrix for all three
}


def _int_array(x, name, shape_hint):
    x = np.asarray(x)
    if x.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer token ids {shape_hint}, got dtype {x.dtype}")
    return x


class KVRecallModel(Model):
    """One attention layer that looks a query key up among stored key/value pairs.

    The model of both ``kv-recall`` and ``partner``: the tasks differ only in
    which stored value is the answer (the query key's own, or its partner's).

    The sequence ``(k_1, v_1), ..., (k_P, v_P), q`` becomes ``P + 1`` tokens:
    stored item ``i`` is ``embed_key[k_i] + embed_value[v_i]``, the final
    token is ``embed_key[q] + query_marker``. The final token's query attends
    over the ``P`` items' keys; the attended value goes through a linear
    readout to ``V`` logits.

    Parameters
    ----------
    num_keys, num_values : int
        ``K`` and ``V``, vocabulary sizes.
    dim : int
        ``E``, size of embeddings, queries, keys and values.
    variant : {"separate", "tied_qk", "no_value", "shared"}
        How the projections are tied (see :data:`VARIANTS`): independent
        ``W_query, W_key, W_value``; one ``W_qk`` for queries and keys;
        no value projection (values are the item tokens); one ``W_shared``
        for all three.
    rng : numpy.random.Generator or int, optional
        Seed or Generator of the initial weights (a new unseeded Generator if None).
    dtype : float dtype
        Floating dtype of the parameters and the computation (float32 or float64).
    dropout : float
        Dropout on the attention weights in training mode (keyword-only);
        the masks come from ``dropout_rng``, spawned from ``rng`` after
        every weight is drawn.

    Attributes
    ----------
    params : dict
        ``embed_key.weight (K, E)``, ``embed_value.weight (V, E)``,
        ``query_marker (E,)``, the variant's ``attention.W_* (E, E)``,
        ``readout.W (E, V)``, ``readout.b (V,)``.
    grads : dict

    Notes
    -----
    Forward, for one sequence with items :math:`X \\in R^{P \\times E}` and
    final token :math:`x_q`:

    .. math:: q = x_q W_q, \\quad K = X W_k, \\quad V = X W_v, \\quad
              a = \\mathrm{softmax}(q K^T / \\sqrt{E})\\, V, \\quad
              \\ell = a W_r + b_r

    With one query, the code folds the key and value projections onto it
    (matrix products associate), and never forms ``K`` or ``V``:

    .. math:: q K^T = (q W_k^T)\\, X^T, \\qquad
              \\mathrm{softmax}(\\cdot)\\, V = (\\mathrm{softmax}(\\cdot)\\, X)\\, W_v

    so the library's attention runs on the query :math:`q W_k^T` with the
    items as keys and values, and :math:`W_v` maps its one output row. That
    costs :math:`3 E^2` multiply-adds a sequence for the three projections,
    against :math:`(2P + 1) E^2` for projecting the ``P`` items, with the
    same function and weights (PyTorch's rebuild in
    ``tests/training/test_trajectory_torch.py`` forms ``K`` and ``V``, and
    is its oracle).

    Backward, in reverse: readout backward gives :math:`\\bar a`; the value
    map gives :math:`\\bar W_v` and the attention output's gradient; attention
    backward gives the query's gradient and the items' (as keys plus as
    values: ``qkvnp.kernels.kv_recall.items_backward_factors`` gives
    their sum as a product :math:`\\bar X = L^T R`, left unmultiplied); the query
    map :math:`q' = q W_k^T` gives :math:`\\bar W_k = \\bar{q}'^T q` and
    :math:`\\bar q`; the query projection gives :math:`\\bar W_q = x_q^T \\bar q`
    and :math:`\\bar x_q`. A tied matrix receives
    the **sum** of the gradients of its uses (``W_qk`` gets both its
    :math:`\\bar W_q` and its :math:`\\bar W_k`), exactly as an input used twice
    does. The items' gradient flows into both embedding tables: each takes
    :math:`O^T \\bar X = (L O)^T R` with :math:`O` its lookup's one-hot matrix
    (``embedding_backward_factored``), so the ``(B, P, E)`` gradient
    :math:`\\bar X` is never formed. The query token's gradient flows into
    ``query_marker`` and, through the query's own lookup, into ``embed_key`` too.

    Examples
    --------
    >>> model = KVRecallModel(num_keys=6, num_values=4, dim=8, rng=0)
    >>> keys, values, query = np.array([[0, 3, 5]]), np.array([[1, 1, 2]]), np.array([3])
    >>> logits = model.forward(keys, values, query)
    >>> logits.shape
    (1, 4)
    >>> model.backward(np.ones((1, 4)))
    >>> sorted(model.grads) == sorted(model.params)
    True
    """

    def __init__(self, num_keys: int, num_values: int, dim: int, variant: str = "separate",
                 rng: np.random.Generator | int | None = None, dtype: DTypeLike = np.float64, *,
                 dropout: float = 0.0) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {variant!r}")
        rng = make_rng(rng)
        self.variant = variant
        self.dtype = layer_dtype(dtype)
        self.embed_key = Embedding(num_keys, dim, rng=rng, dtype=self.dtype)
        self.embed_value = Embedding(num_values, dim, rng=rng, dtype=self.dtype)
        self.num_keys, self.num_values, self.dim = num_keys, num_values, dim
        self.readout = Linear(dim, num_values, rng=rng, dtype=self.dtype)
        self._own = {"query_marker": rng.standard_normal(dim).astype(self.dtype)}
        # the query's and the key's matrix, and the value's (None: no value projection)
        self.roles: tuple[str, str, Optional[str]] = tuple(  # type: ignore[assignment]
            None if name is None else "attention." + name for name in VARIANTS[variant])
        for name in dict.fromkeys(self.roles):  # each distinct matrix once, in order
            if name is not None:
                self._own[name] = xavier_uniform(rng, dim, dim, self.dtype)
        self.dropout = check_dropout_p(dropout, "dropout")
        self.dropout_rng = spawn_generator(rng)
        self._own_generators = {"dropout_rng": self.dropout_rng}
        self._cache = None  # the sub-layers registered by assignment, in this order
        self.zero_grad()

    def forward(self, keys: IntArray, values: IntArray, query: IntArray,
                return_weights: bool = False) -> FloatArray | tuple[FloatArray, FloatArray]:
        """Logits of the value stored under ``query``.

        Parameters
        ----------
        keys, values : ndarray of int, shape (B, P)
            The stored pairs; keys in ``[0, K)``, values in ``[0, V)``.
        query : ndarray of int, shape (B,)
            The key asked for.
        return_weights : bool
            Also return the attention weights of the query over the items.

        Returns
        -------
        logits : ndarray, shape (B, V)
        weights : ndarray, shape (B, P)
            Only with ``return_weights=True``.
        """
        keys = _int_array(keys, "keys", "(B, P)")
        values = _int_array(values, "values", "(B, P)")
        query = _int_array(query, "query", "(B,)")
        if keys.ndim != 2:
            raise ValueError(f"keys must have shape (B, P), got shape {keys.shape}")
        if values.shape != keys.shape:
            raise ValueError(f"values must have the shape of keys {keys.shape}, got shape {values.shape}")
        if query.shape != keys.shape[:1]:
            raise ValueError(f"query must have shape {keys.shape[:1]} (B,), got shape {query.shape}")
        own, (role_q, role_k, role_v) = self._own, self.roles
        # the lookups' caches stay with the model: their backward is folded (backward)
        key_vectors, keys_cache = F.embedding_forward(
            keys, self.embed_key.params["weight"])  # (B, P) -> (B, P, E)
        items, values_cache = F.embedding_forward(
            values, self.embed_value.params["weight"])  # (B, P) -> (B, P, E), take's own new array
        items += key_vectors  # in place: embed_value[v_i] + embed_key[k_i]
        # NOTE: the query's key is looked up apart, in the same table (whose
        # gradient then sums both uses): one lookup of the concatenated ids
        # needs the items' gradient copied into a (B, P+1, E) array in the
        # backward, a slower step (measured in benchmarks/NOTES.md)
        query_token, query_cache = F.embedding_forward(
            query, self.embed_key.params["weight"])  # (B,) -> (B, E)
        query_token += own["query_marker"]  # in place: take's own new array
        # NOTE: check=False: no second check or copy of the model's own arrays
        # (made from checked ids), a share of each step worth saving (measured in
        # benchmarks/NOTES.md). The weights the caches keep are copies taken
        # here: the backward differentiates this forward even if the
        # parameters are edited before it (qkvnp.layers.Layer)
        matrices = {role: own[role].copy() for role in (role_q, role_k, role_v) if role}
        q, q_cache = F.linear_forward(query_token, matrices[role_q], check=False)  # (B, E) -> (B, E)
        # NOTE: the projections are folded onto the one query (see Notes):
        # q K^T = (q W_k^T) X^T and softmax(.) V = (softmax(.) X) W_v, so the
        # P items are never projected: E^2 multiply-adds a sequence per
        # matrix instead of P E^2 (about half the step, measured in
        # benchmarks/NOTES.md). The query side stays 2-D: numpy multiplies a
        # (B, 1, E) stack as B separate products, slower than one 2-D product
        q_items, qk_cache = F.linear_forward(q, matrices[role_k].T, check=False)  # (B, E) -> (B, E)
        drawn = self.training and self.dropout > 0
        if drawn:
            journal_generator(self.dropout_rng)  # a refused call puts its state back
        mixed, attention_cache = F.attention_forward(
            q_items[:, None], items, items, dropout_p=self.dropout if drawn else 0.0,
            rng=self.dropout_rng, check=False)  # (B, 1, E), (B, P, E), (B, P, E) -> (B, 1, E)
        if role_v is None:
            attended, v_cache = mixed[:, 0], None  # NOTE: no value projection: values are the items
        else:
            attended, v_cache = F.linear_forward(mixed[:, 0], matrices[role_v],
                                                 check=False)  # (B, E) -> (B, E)
        logits = self.readout.forward(attended, check=False)  # (B, E) -> (B, V)
        self._cache = (keys_cache, values_cache, query_cache, q_cache, qk_cache, attention_cache,
                       v_cache, logits.shape)
        if return_weights:
            return logits, F.dropped_weights(attention_cache)[:, 0]  # (B, 1, P) -> (B, P)
        return logits

    def backward(self, dlogits: FloatArray, retain_cache: bool = False) -> None:
        """Accumulate every parameter's gradient into ``grads``.

        Parameters
        ----------
        dlogits : ndarray, shape (B, V)
            Same shape as the forward output.
        retain_cache : bool
            Keep the forward's caches (this model's and its layers') for one
            more backward; by default a backward uses them up.

        Returns
        -------
        None
            The inputs are integer ids: they have no gradient.

        Raises
        ------
        TypeError
            If ``dlogits`` does not hold real numbers.
        ValueError
            If ``dlogits`` has another shape or holds NaN or inf.
        RuntimeError
            Before a forward, or on a second backward of one forward.
        """
        (keys_cache, values_cache, query_cache, q_cache, qk_cache, attention_cache, v_cache,
         logits_shape) = self._need_cache()
        dlogits = as_upstream_grad(dlogits, "dlogits", logits_shape, self.dtype)
        role_q, role_k, role_v = self.roles
        # reverse order of forward, one line for one line; check=False: the
        # gradients computed here from a checked dlogits are not checked again,
        # so no error blames the user's "dout"
        dattended = self.readout.backward(dlogits, retain_cache, check=False)  # (B, V) -> (B, E)
        if role_v is None:
            dmixed = dattended
        else:
            dmixed, dW_value, _ = F.linear_backward(dattended, v_cache, check=False)
            self._accumulate_own(role_v, dW_value)
        # the items are the attention's keys and its values: they get the sum of
        # both gradients, dX = left^T right (key_value_factors' Notes), left
        # as factors: only the two tables need dX, and each folds its one-hot
        # product onto left (embedding_backward_factored), so the (B, P, E)
        # gradient is never formed
        dq_items, left, right = items_backward_factors(
            dmixed[:, None], attention_cache)  # (B, 1, E) -> (B, 1, E), (B, 2, P), (B, 2, E)
        # dW_key_t: the gradient of W_k^T, the matrix the query map multiplied by
        dq, dW_key_t, _ = F.linear_backward(dq_items[:, 0], qk_cache, check=False)  # (B, E)
        self._accumulate_own(role_k, dW_key_t.T)  # a tied matrix sums the gradients of its uses
        dquery_token, dW_query, _ = F.linear_backward(dq, q_cache, check=False)
        self._accumulate_own(role_q, dW_query)
        self._accumulate_own("query_marker", dquery_token.sum(axis=0))  # (B, E) -> (E,)
        # items = embed_value[v] + embed_key[k]: both tables get the items' gradient
        # NOTE: every addition into grads is locked (Layer._accumulate), as the
        # layers' own: backwards from several threads add as if serial
        self.embed_value._accumulate("weight", F.embedding_backward_factored(
            left, right, values_cache))  # (B, 2, P), (B, 2, E) -> (V, E)
        self.embed_key._accumulate("weight", F.embedding_backward_factored(
            left, right, keys_cache))  # (B, 2, P), (B, 2, E) -> (K, E)
        # the key table's second use, the query's lookup: its gradient adds up
        self.embed_key._accumulate("weight", F.embedding_backward(
            dquery_token, query_cache, check=False))  # (B, E) -> (K, E)
        self._release_cache(retain_cache)
        return None


class AttentionRegressor(Model):
    """The teacher task's student: one :class:`~qkvnp.MultiHeadAttention`.

    Parameters
    ----------
    embed_dim, num_heads : int
        Width ``E`` of the attention layer. Number of heads ``H``; must divide ``embed_dim``.
    rng : numpy.random.Generator or int, optional
        Seed or Generator of the initial weights (a new unseeded Generator if None).
    dtype : float dtype
        Floating dtype of the parameters and the computation (float32 or float64).
    dropout : float
        The attention layer's ``dropout`` (keyword-only).

    Attributes
    ----------
    params : dict
        ``attention.W_query``, ``attention.W_key``, ``attention.W_value``,
        ``attention.W_out`` ``(E, E)`` and ``attention.b_*`` ``(E,)``.

    Examples
    --------
    >>> student = AttentionRegressor(8, 2, rng=0)
    >>> student.forward(np.ones((2, 5, 8))).shape
    (2, 5, 8)
    >>> sorted(student.params)[:2]
    ['attention.W_key', 'attention.W_out']
    """

    def __init__(self, embed_dim: int, num_heads: int,
                 rng: np.random.Generator | int | None = None, dtype: DTypeLike = np.float64, *,
                 dropout: float = 0.0) -> None:
        self.attention = MultiHeadAttention(embed_dim, num_heads, bias=True, rng=make_rng(rng),
                                            dtype=dtype, dropout=dropout)
        self.dtype = self.attention.dtype
        self._cache = None
        self.zero_grad()

    def forward(self, x: FloatArray, return_weights: bool = False) -> Any:
        """Self-attention of ``x``: ``(B, T, E) -> (B, T, E)`` (and weights ``(B, H, T, T)``)."""
        self._cache = True
        return self.attention.forward(x, return_weights=return_weights)

    def backward(self, dout: FloatArray, retain_cache: bool = False) -> Any:
        """Accumulate into ``grads``; return ``dx`` ``(B, T, E)``."""
        self._need_cache()
        dx = self.attention.backward(dout, retain_cache)
        self._release_cache(retain_cache)
        return dx
