"""Training tasks generated on the fly from a seeded generator (nothing to download).

Shape key: B batch, P stored key/value pairs per sequence, T sequence length,
E embedding.

``kv-recall``
    The database analogy of popular attention tutorials made literal. A sequence stores ``P`` pairs
    ``(key, value)`` with distinct keys, then asks for one of the keys; the
    answer is the value stored under it. To answer, attention has to match
    the *query* against the *keys* and return the matching *value*.
``partner``
    The asymmetric variant: a fixed random pairing ``pi`` of the key
    vocabulary (an involution without fixed points, drawn from the run's
    seed) gives each key a partner. Every sequence stores both the query key
    ``q`` and ``pi(q)``; the answer is the value stored under ``pi(q)``. The
    query's own entry is the distractor: with tied ``Q = K`` the score is a
    symmetric form, and for each pair of partners one of the two queries
    prefers its own entry (``docs/derivations.md``, section 13).
``teacher``
    A student :class:`~qkvnp.MultiHeadAttention` learns to reproduce the
    outputs of a randomly initialised teacher of the same shape (regression).

Every random draw comes from one :class:`numpy.random.SeedSequence` split
into independent streams (:func:`make_streams`): model initialisation,
training batches, the held-out set and the task's own draws (the teacher's
weights, the partner pairing). The held-out
set therefore never shares a draw with the training stream, and a run is a
pure function of its seed.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from .._checks import check_int, make_rng

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from .._typing import DTypeLike

__all__ = [
    "Streams",
    "make_streams",
    "KVBatch",
    "KVRecallTask",
    "PartnerBatch",
    "PartnerTask",
    "draw_pairing",
    "TeacherBatch",
    "TeacherTask",
    "TASKS",
]

Streams = namedtuple("Streams", "init data heldout teacher")
KVBatch = namedtuple("KVBatch", "keys values query target position")
PartnerBatch = namedtuple("PartnerBatch", "keys values query target position own")
TeacherBatch = namedtuple("TeacherBatch", "x target")


def make_streams(seed: int) -> Streams:
    """Four independent generators derived from one integer ``seed``.

    Parameters
    ----------
    seed : int
        Non-negative.

    Returns
    -------
    Streams
        ``init`` (model weights), ``data`` (training batches), ``heldout``
        (the evaluation set), ``teacher`` (the task's own draws: the
        teacher's weights, or the partner task's pairing).

    Examples
    --------
    >>> a, b = make_streams(0), make_streams(0)
    >>> int(a.data.integers(1000)) == int(b.data.integers(1000))
    True
    """
    seed = check_int(seed, "seed", 0)
    children = np.random.SeedSequence(seed).spawn(4)
    return Streams(*(np.random.Generator(np.random.PCG64(child)) for child in children))


class KVRecallTask:
    """Key/value recall: store ``num_pairs`` pairs, then ask for one key's value.

    Parameters
    ----------
    num_keys : int
        Size of the key vocabulary; must be at least ``num_pairs`` (keys of a
        sequence are distinct, so that the answer is unique).
    num_values : int
        Size of the value vocabulary (values may repeat within a sequence).
    num_pairs : int
        ``P``, pairs stored per sequence.

    Examples
    --------
    >>> task = KVRecallTask(num_keys=10, num_values=5, num_pairs=3)
    >>> batch = task.sample(np.random.default_rng(0), 4)
    >>> batch.keys.shape, batch.values.shape, batch.query.shape, batch.target.shape
    ((4, 3), (4, 3), (4,), (4,))
    >>> bool((batch.values[np.arange(4), batch.position] == batch.target).all())
    True
    """

    name = "kv-recall"
    kind = "classification"

    def __init__(self, num_keys: int = 32, num_values: int = 32, num_pairs: int = 8) -> None:
        self.num_keys = check_int(num_keys, "num_keys", 1)
        self.num_values = check_int(num_values, "num_values", 1)
        self.num_pairs = check_int(num_pairs, "num_pairs", 1)
        if self.num_pairs > self.num_keys:
            raise ValueError(
                f"num_pairs must be <= num_keys={self.num_keys} (keys of a sequence are "
                f"distinct), got num_pairs={self.num_pairs}"
            )

    def sample(self, rng: np.random.Generator | int | None, batch_size: int) -> KVBatch:
        """Draw ``batch_size`` sequences.

        Parameters
        ----------
        rng : numpy.random.Generator or int
        batch_size : int

        Returns
        -------
        KVBatch
            ``keys`` and ``values`` ``(B, P)`` int64, the stored pairs;
            ``query`` ``(B,)`` int64, the key asked for; ``target`` ``(B,)``
            int64, the value stored under it; ``position`` ``(B,)`` int64, the
            index of the matching pair (for diagnostics and plots only).
        """
        rng = make_rng(rng)
        B = check_int(batch_size, "batch_size", 1)
        P = self.num_pairs
        # distinct keys: the first P entries of a random permutation per row
        keys = np.argsort(rng.random((B, self.num_keys)), axis=1)[:, :P]  # (B, num_keys) -> (B, P)
        values = rng.integers(0, self.num_values, size=(B, P))  # (B, P)
        position = rng.integers(0, P, size=B)  # (B,)
        rows = np.arange(B)
        return KVBatch(keys.astype(np.int64), values.astype(np.int64),
                       keys[rows, position].astype(np.int64),
                       values[rows, position].astype(np.int64), position.astype(np.int64))

    def chance_accuracy(self) -> float:
        """Accuracy of guessing: ``1 / num_values``."""
        return 1.0 / self.num_values


def draw_pairing(num_keys, rng):
    """A random pairing of ``0 .. num_keys-1``: an involution without fixed points.

    Parameters
    ----------
    num_keys : int
        ``K``, even and at least 2.
    rng : numpy.random.Generator or int

    Returns
    -------
    ndarray of int64, shape (K,)
        ``partner`` with ``partner[partner[k]] == k`` and ``partner[k] != k``.

    Raises
    ------
    ValueError
        If ``num_keys`` is odd (some key would be left without a partner).

    Examples
    --------
    >>> partner = draw_pairing(6, 0)
    >>> bool((partner[partner] == np.arange(6)).all()), bool((partner != np.arange(6)).all())
    (True, True)
    """
    K = check_int(num_keys, "num_keys", 2)
    if K % 2:
        raise ValueError(f"num_keys must be even (every key needs a partner), got num_keys={K}")
    order = make_rng(rng).permutation(K)  # (K,); consecutive entries become partners
    partner = np.empty(K, dtype=np.int64)
    partner[order[0::2]] = order[1::2]
    partner[order[1::2]] = order[0::2]
    return partner


class PartnerTask(KVRecallTask):
    """Partner recall: store ``num_pairs`` pairs, ask for the value of the query key's partner.

    The asymmetric task of the Q/K/V ablation. The query key ``q`` and its
    partner ``pi(q)`` are both stored in every sequence (with ``P - 2``
    other distinct keys, in random order); the target is the value stored
    under ``pi(q)``. The query's own entry is therefore always present as a
    distractor.

    Parameters
    ----------
    num_keys : int
        Size of the key vocabulary: even, and at least ``num_pairs``.
    num_values : int
        Size of the value vocabulary (values may repeat within a sequence).
    num_pairs : int
        ``P >= 2``, pairs stored per sequence.
    rng : numpy.random.Generator or int
        Source of the pairing (``make_streams(seed).teacher``): the pairing
        is a fixed property of the run, the same for every batch.

    Attributes
    ----------
    partner : ndarray of int64, shape (K,)
        The pairing ``pi`` (see ``draw_pairing``).

    Notes
    -----
    Why ``Q = K`` fails here: with one matrix ``W`` for queries and keys the
    score of a query token ``x`` for an item ``y`` is ``x^T M y`` with
    ``M = W W^T`` symmetric positive semi-definite. For partners ``a, b`` and
    a query marker ``c``, the two margins "partner's score minus own score"
    add up to ``-(a - b)^T M (a - b) <= 0``: at least one of the two
    queries does not prefer its partner. ``docs/derivations.md``, section 13.

    Examples
    --------
    >>> task = PartnerTask(num_keys=10, num_values=5, num_pairs=3, rng=0)
    >>> batch = task.sample(np.random.default_rng(0), 4)
    >>> rows = np.arange(4)
    >>> bool((batch.keys[rows, batch.position] == task.partner[batch.query]).all())
    True
    >>> bool((batch.keys[rows, batch.own] == batch.query).all())
    True
    >>> bool((batch.values[rows, batch.position] == batch.target).all())
    True
    """

    name = "partner"
    kind = "classification"

    def __init__(self, num_keys: int = 64, num_values: int = 64, num_pairs: int = 16,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__(num_keys, num_values, num_pairs)
        if self.num_pairs < 2:
            raise ValueError(f"num_pairs must be >= 2 (the query key and its partner are both "
                             f"stored), got num_pairs={self.num_pairs}")
        self.partner = draw_pairing(self.num_keys, rng)

    def sample(self, rng: np.random.Generator | int | None,  # type: ignore[override]
               batch_size: int) -> PartnerBatch:  # KVBatch's fields and ``own``
        """Draw ``batch_size`` sequences.

        Parameters
        ----------
        rng : numpy.random.Generator or int
        batch_size : int

        Returns
        -------
        PartnerBatch
            ``keys`` and ``values`` ``(B, P)`` int64, the stored pairs (the
            query key and its partner among them); ``query`` ``(B,)``;
            ``target`` ``(B,)``, the value stored under the partner;
            ``position`` ``(B,)``, the partner's index; ``own`` ``(B,)``,
            the query key's own index (the distractor).
        """
        rng = make_rng(rng)
        B = check_int(batch_size, "batch_size", 1)
        K, P = self.num_keys, self.num_pairs
        rows = np.arange(B)
        query = rng.integers(0, K, size=B)  # (B,)
        partner = self.partner[query]  # (B,)
        # distinct keys: q and pi(q) sort first, then P - 2 others at random
        draw = rng.random((B, K))  # (B, K)
        draw[rows, query] = -2.0
        draw[rows, partner] = -1.0
        chosen = np.argsort(draw, axis=1)[:, :P]  # (B, K) -> (B, P): q, pi(q), others
        order = np.argsort(rng.random((B, P)), axis=1)  # (B, P): a random order per row
        keys = np.take_along_axis(chosen, order, axis=1)  # (B, P)
        inverse = np.argsort(order, axis=1)  # where each chosen slot went
        own, position = inverse[:, 0], inverse[:, 1]  # (B,) each
        values = rng.integers(0, self.num_values, size=(B, P))  # (B, P)
        return PartnerBatch(keys.astype(np.int64), values.astype(np.int64),
                            query.astype(np.int64), values[rows, position].astype(np.int64),
                            position.astype(np.int64), own.astype(np.int64))


class TeacherTask:
    """Regression onto a random teacher :class:`~qkvnp.MultiHeadAttention`.

    Parameters
    ----------
    embed_dim, num_heads : int
        Shape of the teacher (and of the student that learns it).
    seq_len : int
        ``T``, tokens per input sequence.
    rng : numpy.random.Generator or int
        Source of the teacher's weights (``make_streams(seed).teacher``).
    dtype : float dtype
        Floating dtype of the parameters and the computation (float32 or float64).

    Notes
    -----
    Inputs are standard normal ``(B, T, E)``; the target is the teacher's
    self-attention output. The teacher has biases drawn from N(0, 0.1^2), so
    that the student cannot fit them by staying at its zero initial biases.

    Examples
    --------
    >>> task = TeacherTask(8, 2, 5, rng=0)
    >>> batch = task.sample(np.random.default_rng(1), 3)
    >>> batch.x.shape, batch.target.shape
    ((3, 5, 8), (3, 5, 8))
    """

    name = "teacher"
    kind = "regression"

    def __init__(self, embed_dim: int = 16, num_heads: int = 2, seq_len: int = 8,
                 rng: np.random.Generator | int | None = None,
                 dtype: DTypeLike = np.float64) -> None:
        from ..layers import MultiHeadAttention

        rng = make_rng(rng)
        self.seq_len = check_int(seq_len, "seq_len", 1)
        self.teacher = MultiHeadAttention(embed_dim, num_heads, bias=True, rng=rng, dtype=dtype)
        for name in ("b_query", "b_key", "b_value", "b_out"):
            bias = self.teacher.params[name]
            bias[...] = 0.1 * rng.standard_normal(bias.shape)
        self.embed_dim = self.teacher.embed_dim
        self.num_heads = self.teacher.num_heads
        self.dtype = self.teacher.dtype

    def sample(self, rng: np.random.Generator, batch_size: int) -> TeacherBatch:
        """Draw ``batch_size`` inputs and the teacher's outputs.

        Returns
        -------
        TeacherBatch
            ``x`` ``(B, T, E)`` standard normal, ``target`` ``(B, T, E)``.
        """
        rng = make_rng(rng)
        B = check_int(batch_size, "batch_size", 1)
        x = rng.standard_normal((B, self.seq_len, self.embed_dim)).astype(self.dtype)  # (B, T, E)
        return TeacherBatch(x, self.teacher.forward(x))


TASKS = ("kv-recall", "partner", "teacher")
