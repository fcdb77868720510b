"""Walk through attention step by step, printing every number.

Shape key: T tokens (6 in the journey example, 4 in the numpy example),
E embedding size of a token (3), D size of queries, keys and values (2 in the
journey example, 3 in the numpy example).

Attention is a soft database lookup. Every token asks a question (its
*query*), every token offers a label (its *key*) and a payload (its *value*).
A query is matched against every key; the match scores, turned by a softmax
into weights that sum to 1, mix the values into the token's *context vector*.

The main example is the six-token sentence "Your journey starts with one
step" of Sebastian Raschka's *Build a Large Language Model (From Scratch)*
(Manning, 2024), chapter 3: its hand-picked 3-d embeddings and its 3x2
projection matrices (``torch.rand`` after ``torch.manual_seed(123)``).

The walkthrough has four parts, each computed through the public API
(:mod:`qkvnp.functional`, :func:`qkvnp.softmax`,
:func:`qkvnp.scaled_dot_product_attention`, :class:`qkvnp.SelfAttention`,
:class:`qkvnp.MultiHeadAttention`, :mod:`qkvnp.interop`):

1. "Your journey starts with one step": query token 2 ("journey") alone,
   then all six tokens at once with :class:`~qkvnp.SelfAttention` whose
   weights are set to the book's matrices, cross-checked against the
   functional ops.
2. A plain-numpy example: four integer "words" and integer weight matrices.
3. Attention without trainable weights: ``scores = X X^T``.
4. The book's chapter 3 multi-head layer (``d_in = 3``, ``d_out = 2``, two
   heads, causal) with the weights torch gives it under the book's seed
   (:data:`BOOK_MHA_STATE`), which reproduce the book's printed context vectors.

It ends with a pointer to ``python -m qkvnp ablation``, the experiment that
answers the question every learner asks: why three matrices, and not one?

``python -m qkvnp demo --precision 8`` prints 8 digits. The command exits with 1 if a cross-check between two code paths
fails, 0 otherwise.

Examples
--------
>>> import io, contextlib
>>> buffer = io.StringIO()
>>> with contextlib.redirect_stdout(buffer):
...     status = walkthrough(precision=4)
>>> status, "[0.4306, 1.4551]" in buffer.getvalue()
(0, True)
"""
import argparse

import numpy as np

from .. import functional as F
from .._checks import check_int
from ..functional import scaled_dot_product_attention, softmax
from ..interop import from_torch
from ..layers import MultiHeadAttention, SelfAttention

__all__ = [
    "WORDS",
    "INPUTS",
    "W_QUERY",
    "W_KEY",
    "W_VALUE",
    "NUMPY_WORDS",
    "NUMPY_W_Q",
    "NUMPY_W_K",
    "NUMPY_W_V",
    "BOOK_MHA_STATE",
    "BOOK_MHA_PRINTED",
    "add_arguments",
    "run",
    "walkthrough",
]

# ---------------------------------------------------------------- example data
# Provenance: the book's "self-attention from scratch" walkthrough (the
# six-token sentence with hand-picked 3-d embeddings and random 3x2 projection
# matrices, printed there to 8 digits; Sebastian Raschka, Build a Large
# Language Model (From Scratch), chapter 3).
# Attention without weights uses the same INPUTS.
WORDS = ("Your", "journey", "starts", "with", "one", "step")
INPUTS = np.array(
    [
        [0.43, 0.15, 0.89],  # Your     (x^1)
        [0.55, 0.87, 0.66],  # journey  (x^2)
        [0.57, 0.85, 0.64],  # starts   (x^3)
        [0.22, 0.58, 0.33],  # with     (x^4)
        [0.77, 0.25, 0.10],  # one      (x^5)
        [0.05, 0.80, 0.55],  # step     (x^6)
    ]
)
W_QUERY = np.array(
    [[0.29611194, 0.51656228], [0.25167072, 0.68855679], [0.07397246, 0.86652195]]
)
W_KEY = np.array(
    [[0.13657987, 0.10247904], [0.18405646, 0.72644675], [0.31525391, 0.68710667]]
)
W_VALUE = np.array(
    [[0.07563531, 0.19663817], [0.31641197, 0.40174013], [0.1185683, 0.82739538]]
)

# Provenance: a popular tutorial's plain-numpy attention example (four integer "words"
# and integer weight matrices with entries 0..2, as numpy.random.randint(3,
# size=(3, 3)) draws them). qkvnp promotes
# integer input to float64.
NUMPY_WORDS = np.array([[1, 0, 0], [0, 1, 0], [1, 1, 0], [0, 0, 1]])
NUMPY_W_Q = np.array([[2, 0, 2], [2, 0, 0], [2, 1, 2]])
NUMPY_W_K = np.array([[2, 2, 2], [0, 2, 1], [0, 1, 1]])
NUMPY_W_V = np.array([[1, 1, 0], [0, 1, 1], [0, 0, 0]])

# Provenance: the book's chapter 3 MultiHeadAttention(d_in=3, d_out=2,
# context_length=6, dropout=0.0, num_heads=2) built after torch.manual_seed(123),
# its state_dict (float32, written here exactly as float64, in torch's layout:
# nn.Linear weights are (out_features, in_features); the mask buffer left out).
# tests/apps/test_demo.py rebuilds it in torch and checks these values bit for bit.
BOOK_MHA_STATE = {
    "W_query.weight": np.array([[-0.23542964458465576, 0.019124476239085197, -0.28674593567848206],
                                [0.21772661805152893, -0.491934210062027, 0.423223078250885]]),
    "W_key.weight": np.array([[-0.4196414053440094, -0.45901766419410706, -0.3648201823234558],
                              [0.2614781856536865, -0.21332639455795288, 0.21605217456817627]]),
    "W_value.weight": np.array([[-0.49001413583755493, -0.35029205679893494, -0.21198919415473938],
                                [-0.1134607195854187, -0.440439373254776, 0.37804362177848816]]),
    "out_proj.weight": np.array([[-0.16675779223442078, 0.2269725799560547],
                                 [0.5000259876251221, 0.13173823058605194]]),
    "out_proj.bias": np.array([0.1933588683605194, 0.6825409531593323]),
}
# The context vectors the book prints for that layer on its batch of two
# copies of INPUTS (4 decimals, computed by torch in float32).
BOOK_MHA_PRINTED = np.array([[0.3190, 0.4858], [0.2943, 0.3897], [0.2856, 0.3593],
                             [0.2693, 0.3873], [0.2639, 0.3928], [0.2575, 0.4028]])

QUERY_TOKEN = 2  # the book counts tokens from 1: x^2 = INPUTS[1] = "journey"

# Two code paths computing the same float64 numbers may differ by round-off
# only: a few ulps of values of order 1.
_CROSS_CHECK_ATOL = 1e-12


# ---------------------------------------------------------------- command line


def add_arguments(parser):
    """Add the ``demo`` options to an ``argparse`` parser."""
    parser.add_argument(
        "--precision",
        type=_precision,
        default=4,
        metavar="N",
        help="digits printed after the decimal point (default 4, as the book prints)",
    )


def _precision(text):
    """``type=`` of ``--precision``: an int in 0..16 (float64 has ~16 digits)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--precision must be an int, got {text!r}") from None
    if not 0 <= value <= 16:
        raise argparse.ArgumentTypeError(f"--precision must be in 0..16, got {value}")
    return value


def run(args):
    """Run the walkthrough with the parsed ``args``; return the exit code."""
    return walkthrough(precision=args.precision)


# ---------------------------------------------------------------- printing


class _Printer:
    """Fixed-precision printing of arrays, with optional row labels."""

    def __init__(self, precision):
        self.precision = precision

    def array(self, a):
        a = np.asarray(a)
        if a.dtype.kind in "iub":
            return np.array2string(a, separator=", ")
        return np.array2string(
            a, precision=self.precision, floatmode="fixed", suppress_small=True,
            separator=", ", max_line_width=120,
        )

    def show(self, label, a):
        text = self.array(a)
        if "\n" in text:
            print(f"{label} =")
            print("    " + text.replace("\n", "\n    "))
        else:
            print(f"{label} = {text}")

    def rows(self, label, matrix, row_labels):
        """Print a matrix one labelled row per line, columns aligned."""
        matrix = np.asarray(matrix)
        if matrix.dtype.kind in "iub":
            cells = [[str(int(v)) for v in row] for row in matrix]
        else:
            cells = [[f"{v:.{self.precision}f}" for v in row] for row in matrix]
        cell_width = max(len(c) for row in cells for c in row)
        name_width = max(len(name) for name in row_labels)
        print(f"{label} =")
        for name, row in zip(row_labels, cells):
            print(f"    {name:>{name_width}}  [" + ", ".join(c.rjust(cell_width) for c in row) + "]")

    @staticmethod
    def heading(text):
        print()
        print(text)
        print("-" * len(text))

    @staticmethod
    def say(*lines):
        for line in lines:
            print(line)


def _cross_check(label, a, b):
    """Print the largest difference between two code paths; True if they agree."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        print(f"cross-check {label}: shapes differ, {a.shape} vs {b.shape}  FAILED")
        return False
    worst = float(np.max(np.abs(a - b))) if a.size else 0.0
    ok = worst <= _CROSS_CHECK_ATOL
    print(f"cross-check {label}: max |difference| = {worst:.1e}  {'ok' if ok else 'FAILED'}")
    return ok


# ---------------------------------------------------------------- the walkthrough


def walkthrough(precision=4):
    """Print the attention examples step by step.

    Parameters
    ----------
    precision : int
        Digits after the decimal point.

    Returns
    -------
    int
        0 when every cross-check between two code paths agrees, 1 otherwise.

    Raises
    ------
    TypeError
        If ``precision`` is not an int.
    ValueError
        If ``precision`` is outside 0..16.
    """
    precision = check_int(precision, "precision", 0, 16, expected="an int in 0..16")
    p = _Printer(precision)
    ok = _journey_one_query(p)
    ok &= _journey_all_tokens(p)
    ok &= _numpy_example(p)
    ok &= _without_weights(p)
    ok &= _book_multi_head(p)
    _why_three_matrices(p)
    print()
    print("All cross-checks agree." if ok else "Some cross-check FAILED (see above).")
    return 0 if ok else 1


def _journey_one_query(p):
    """Part 1a: one query, "journey", matched against every key."""
    _journey_introduction(p)
    word = WORDS[QUERY_TOKEN - 1]
    query_2, keys, values, scores_2 = _journey_scores(p, word)
    weights_2 = _journey_softmax(p, scores_2, keys.shape[-1])

    p.heading(f"Step 5. The context vector of {word!r}: the weights mix the values")
    context_2, weights_check = scaled_dot_product_attention(
        query_2[None, :], keys, values, return_weights=True
    )  # (1, D), (T, D), (T, D) -> (1, D), (1, T)
    p.show(f"context z^{QUERY_TOKEN} = weights_{QUERY_TOKEN} @ values", context_2[0])
    return _cross_check(
        "weights (softmax vs scaled_dot_product_attention)", weights_2, weights_check[0]
    )


def _journey_introduction(p):
    """Attention as a lookup, the book's sentence and its three matrices."""
    p.say(
        "Attention as a soft database lookup: a token's QUERY is matched against",
        "the KEY of every token; the match weights (a softmax of the scores, summing",
        "to 1) mix the VALUES of the tokens into the token's CONTEXT VECTOR.",
    )
    p.heading("Part 1. \"Your journey starts with one step\"")
    p.say(
        "The six-token sentence of Sebastian Raschka's Build a Large Language Model",
        "(From Scratch), chapter 3. Each token is a 3-d embedding (T = 6 tokens, E = 3):",
    )
    p.rows("inputs (T, E)", INPUTS, WORDS)
    p.say(
        "",
        "Three trainable matrices project a token to its query, key and value",
        "(d_in = 3 -> d_out = d_k = 2, the book's x @ W convention):",
    )
    p.show("W_query (E, D)", W_QUERY)
    p.show("W_key (E, D)", W_KEY)
    p.show("W_value (E, D)", W_VALUE)


def _journey_scores(p, word):
    """Steps 1 to 3: the query of ``word``, every key and value, the query's scores."""
    x_2 = INPUTS[QUERY_TOKEN - 1]
    p.heading(f"Step 1. The query of token {QUERY_TOKEN}, {word!r} (inputs[{QUERY_TOKEN - 1}])")
    query_2, _ = F.linear_forward(x_2, W_QUERY)  # (E,) -> (D,)
    p.show(f"x^{QUERY_TOKEN}", x_2)
    p.show(f"query q^{QUERY_TOKEN} = x^{QUERY_TOKEN} @ W_query", query_2)

    p.heading("Step 2. Every token's key and value")
    keys, _ = F.linear_forward(INPUTS, W_KEY)  # (T, E) -> (T, D)
    values, _ = F.linear_forward(INPUTS, W_VALUE)  # (T, E) -> (T, D)
    p.rows("keys = inputs @ W_key (T, D)", keys, WORDS)
    p.rows("values = inputs @ W_value (T, D)", values, WORDS)

    p.heading(f"Step 3. Scores: how well q^{QUERY_TOKEN} matches each key")
    p.say(f"score_{QUERY_TOKEN}j = q^{QUERY_TOKEN} . k^j, i.e. a linear map with keys^T as its matrix:")
    scores_2, _ = F.linear_forward(query_2, keys.T)  # (D,) @ (D, T) -> (T,)
    p.show(f"scores_{QUERY_TOKEN} = q^{QUERY_TOKEN} @ keys^T (T,)", scores_2)
    return query_2, keys, values, scores_2


def _journey_softmax(p, scores_2, d_k):
    """Step 4: the scaled softmax of the scores, and two pitfalls: one score, the wrong scale."""
    scale = 1.0 / np.sqrt(d_k)
    p.heading("Step 4. Scaled softmax: scores -> weights that sum to 1")
    p.say(
        f"Divide by sqrt(d_k) = sqrt({d_k}) before the softmax: a dot product of d_k",
        "unit-variance numbers has variance d_k, and without the scale large scores",
        "saturate the softmax (nearly one-hot weights, vanishing gradients).",
        "NOTE: d_k is the size of the keys (the head dim), not the embedding size;",
        "some Transformer tutorials divide by sqrt(embed_size), a known bug.",
    )
    weights_2 = softmax(scores_2 * scale)  # (T,), sums to 1
    p.show(f"weights_{QUERY_TOKEN} = softmax(scores_{QUERY_TOKEN} / sqrt({d_k}))", weights_2)
    p.say(f"sum of weights_{QUERY_TOKEN} = {weights_2.sum():.{p.precision}f}")
    single = softmax(scores_2[QUERY_TOKEN - 1 : QUERY_TOKEN] * scale)  # (1,) -> (1,)
    p.say(
        "",
        "Pitfall: a softmax applied to the single score",
        f"score_{QUERY_TOKEN}{QUERY_TOKEN}. A softmax over one number is always 1, whatever the number:",
    )
    p.show(f"softmax([score_{QUERY_TOKEN}{QUERY_TOKEN} / sqrt({d_k})])", single)
    p.say(
        "The softmax must run over ALL the scores of the query (one row of the",
        "score matrix): the weights compete with each other, that is the point.",
    )
    wrong_scale = 1.0 / np.sqrt(INPUTS.shape[-1])
    p.show(
        f"weights_{QUERY_TOKEN} with the buggy scale 1/sqrt(E) = 1/sqrt({INPUTS.shape[-1]})",
        softmax(scores_2 * wrong_scale),
    )
    return weights_2


def _journey_all_tokens(p):
    """Part 1b: all six queries at once, with the SelfAttention layer."""
    p.heading("Step 6. All tokens at once: qkvnp.SelfAttention(3, 2)")
    p.say(
        "Stacking the queries into a matrix Q (T, D) gives every score at once,",
        "S = Q K^T / sqrt(d_k) (T, T); a softmax on each row gives the weights,",
        "and Z = weights @ V holds every token's context vector.",
    )
    layer = SelfAttention(INPUTS.shape[-1], W_QUERY.shape[-1])
    for name, matrix in (("W_query", W_QUERY), ("W_key", W_KEY), ("W_value", W_VALUE)):
        layer.params[name][...] = matrix  # (E, D): the book's matrices replace the random init
    context, weights = layer.forward(INPUTS, return_weights=True)  # (T, E) -> (T, D), (T, T)
    p.rows("weights (T, T), row i = token i's weights over keys", weights, WORDS)
    p.say(f"row sums = {p.array(weights.sum(axis=-1))}")
    p.rows("context vectors Z (T, D)", context, WORDS)

    queries, _ = F.linear_forward(INPUTS, W_QUERY)  # (T, E) -> (T, D)
    keys, _ = F.linear_forward(INPUTS, W_KEY)  # (T, E) -> (T, D)
    values, _ = F.linear_forward(INPUTS, W_VALUE)  # (T, E) -> (T, D)
    context_check, cache = F.attention_forward(queries, keys, values)  # -> (T, D)
    ok = _cross_check("context (SelfAttention vs functional)", context, context_check)
    ok &= _cross_check("weights (SelfAttention vs functional)", weights, cache.weights)
    return ok


def _numpy_example(p):
    """Part 2: integer words and randint-style integer weights."""
    p.heading("Part 2. The numpy example: integer words, randint weights")
    p.say(
        "Four words as integer vectors (E = 3) and integer weight matrices as drawn",
        "by numpy.random.randint(3, size=(3, 3)). qkvnp promotes integers to float64.",
    )
    labels = tuple(f"word_{i + 1}" for i in range(len(NUMPY_WORDS)))
    p.rows("words (T, E)", NUMPY_WORDS, labels)
    p.show("W_Q (E, D)", NUMPY_W_Q)
    p.show("W_K (E, D)", NUMPY_W_K)
    p.show("W_V (E, D)", NUMPY_W_V)
    queries, _ = F.linear_forward(NUMPY_WORDS, NUMPY_W_Q)  # (T, E) -> (T, D)
    keys, _ = F.linear_forward(NUMPY_WORDS, NUMPY_W_K)  # (T, E) -> (T, D)
    values, _ = F.linear_forward(NUMPY_WORDS, NUMPY_W_V)  # (T, E) -> (T, D)
    p.rows("queries = words @ W_Q", queries, labels)
    p.rows("keys = words @ W_K", keys, labels)
    p.rows("values = words @ W_V", values, labels)
    d_k = keys.shape[-1]
    scores, _ = F.linear_forward(queries, keys.T)  # (T, D) @ (D, T) -> (T, T)
    p.rows("scores = queries @ keys^T", scores, labels)
    p.say(
        f"Here d_k = {d_k} equals the embedding size, so the scale is 1/sqrt({d_k}) "
        "either way.",
    )
    weights = softmax(scores / np.sqrt(d_k))  # (T, T), rows sum to 1
    p.rows(f"weights = softmax(scores / sqrt({d_k}))", weights, labels)
    attention, weights_check = scaled_dot_product_attention(
        queries, keys, values, return_weights=True
    )  # (T, D) x3 -> (T, D), (T, T); default scale 1/sqrt(D)
    p.rows("attention = weights @ values (T, D)", attention, labels)
    return _cross_check("weights (softmax vs scaled_dot_product_attention)", weights, weights_check)


def _without_weights(p):
    """Part 3: attention with no trainable weights, scores = X X^T."""
    p.heading("Part 3. Attention without trainable weights: scores = X X^T")
    p.say(
        "The simplest attention uses the embeddings themselves as queries, keys and",
        "values. The book does not scale the scores here (scale = 1).",
    )
    word = WORDS[QUERY_TOKEN - 1]
    x_2 = INPUTS[QUERY_TOKEN - 1]
    scores_2, _ = F.linear_forward(x_2, INPUTS.T)  # (E,) @ (E, T) -> (T,)
    p.show(f"scores of {word!r} = x^{QUERY_TOKEN} @ inputs^T", scores_2)
    weights_2 = softmax(scores_2)  # (T,)
    p.show(f"weights of {word!r} = softmax(scores)", weights_2)
    context, weights = scaled_dot_product_attention(
        INPUTS, INPUTS, INPUTS, scale=1.0, return_weights=True
    )  # (T, E) x3 -> (T, E), (T, T)
    p.rows("weights = softmax(X X^T) (T, T)", weights, WORDS)
    p.rows("context vectors = weights @ X (T, E)", context, WORDS)
    p.show(
        "context vectors with 1/sqrt(E) scaling, for comparison (first two rows)",
        scaled_dot_product_attention(INPUTS, INPUTS, INPUTS)[:2],
    )
    return _cross_check(
        f"weights of {word!r} (softmax vs scaled_dot_product_attention)",
        weights_2, weights[QUERY_TOKEN - 1],
    )


def _book_multi_head(p):
    """Part 4: the book's chapter 3 multi-head layer, from weights torch generated."""
    p.heading("Part 4. The book's MultiHeadAttention(d_in=3, d_out=2, num_heads=2)")
    p.say(
        "The book projects d_in = 3 to d_out = 2 (split into 2 heads of 1), with no",
        "input biases and a biased out_proj, and masks causally. In qkvnp that is",
        "MultiHeadAttention(embed_dim=2, num_heads=2, qdim=3, kdim=3, vdim=3,",
        "qkv_bias=False, out_bias=True) called with is_causal=True. Its weights are",
        "the ones torch.manual_seed(123) gives the book's layer, loaded with",
        "qkvnp.interop.from_torch(layer, state, 'book.MultiHeadAttention').",
    )
    batch = np.stack([INPUTS, INPUTS])  # the book's batch: two copies, (2, T, E)
    contexts = []
    for impl in ("fast", "reference"):
        layer = MultiHeadAttention(embed_dim=2, num_heads=2, qdim=3, kdim=3, vdim=3,
                                   qkv_bias=False, out_bias=True, impl=impl)
        from_torch(layer, BOOK_MHA_STATE, "book.MultiHeadAttention")
        contexts.append(layer.forward(batch, is_causal=True))  # (2, T, E) -> (2, T, 2)
    p.rows("context vectors (T, 2), first of the batch", contexts[0][0], WORDS)
    p.rows("the book prints (4 decimals, float32)", BOOK_MHA_PRINTED, WORDS)
    return _cross_check("context (fast vs reference path)", contexts[0], contexts[1])


def _why_three_matrices(p):
    """Why three matrices, and where the answer is: ``python -m qkvnp ablation``."""
    p.heading("Why W_query, W_key and W_value, and not one matrix?")
    p.say(
        "Part 3 used the tokens themselves as queries and keys: its scores X X^T are",
        "symmetric (token i scores token j exactly as j scores i). One shared matrix W",
        "keeps them symmetric: x^T W W^T y. Then for two tokens a and b that should each",
        "look up the other, the two margins 'the other minus myself' add up to",
        "-(a - b)^T W W^T (a - b) <= 0: one of the two prefers itself. Separate W_query",
        "and W_key give x^T W_query W_key^T y, which need not be symmetric.",
        "W_value then decides what a matched token passes on, apart from how it is matched.",
        "  python -m qkvnp ablation     # trains both on a task built for this (partner):",
        "                               # tied Q=K stays near half, separate reaches ~100%,",
        "                               # and no_value / shared show what W_value adds",
        "The derivation: docs/derivations.md, section 13.",
    )
