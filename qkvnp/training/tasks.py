"""Training tasks generated on the fly from a seeded generator (nothing to download).

Shape key: B batch, P stored key/value pairs per sequence, T sequence length,
E embedding.

``kv-recall``
    The seeds' database analogy made literal. A sequence stores ``P`` pairs
    ``(key, value)`` with distinct keys, then asks for one of the keys; the
    answer is the value stored under it. To answer, attention has to match
    the *query* against the *keys* and return the matching *value*.
``teacher``
    A student :class:`~qkvnp.MultiHeadAttention` learns to reproduce the
    outputs of a randomly initialised teacher of the same shape (regression).

Every random draw comes from one :class:`numpy.random.SeedSequence` split
into independent streams (:func:`make_streams`): model initialisation,
training batches, the held-out set and the teacher's weights. The held-out
set therefore never shares a draw with the training stream, and a run is a
pure function of its seed.
"""
from collections import namedtuple

import numpy as np

from .._checks import check_int, make_rng

__all__ = [
    "Streams",
    "make_streams",
    "KVBatch",
    "KVRecallTask",
    "TeacherBatch",
    "TeacherTask",
    "TASKS",
]

Streams = namedtuple("Streams", "init data heldout teacher")
KVBatch = namedtuple("KVBatch", "keys values query target position")
TeacherBatch = namedtuple("TeacherBatch", "x target")


def make_streams(seed):
    """Four independent generators derived from one integer ``seed``.

    Parameters
    ----------
    seed : int
        Non-negative.

    Returns
    -------
    Streams
        ``init`` (model weights), ``data`` (training batches), ``heldout``
        (the evaluation set), ``teacher`` (the teacher's weights).

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

    def __init__(self, num_keys=32, num_values=32, num_pairs=8):
        self.num_keys = check_int(num_keys, "num_keys", 1)
        self.num_values = check_int(num_values, "num_values", 1)
        self.num_pairs = check_int(num_pairs, "num_pairs", 1)
        if self.num_pairs > self.num_keys:
            raise ValueError(
                f"num_pairs must be <= num_keys={self.num_keys} (keys of a sequence are "
                f"distinct), got num_pairs={self.num_pairs}"
            )

    def sample(self, rng, batch_size):
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

    def chance_accuracy(self):
        """Accuracy of guessing: ``1 / num_values``."""
        return 1.0 / self.num_values


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

    def __init__(self, embed_dim=16, num_heads=2, seq_len=8, rng=None, dtype=np.float64):
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

    def sample(self, rng, batch_size):
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


TASKS = ("kv-recall", "teacher")
