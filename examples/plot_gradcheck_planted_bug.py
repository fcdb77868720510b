"""
Checking a backward you wrote
=============================

You wrote an op as a forward returning ``(out, cache)`` and a backward
returning the input's gradient. :func:`qkvnp.gradcheck.check_op` compares
the backward with numerical derivatives of the forward at a random point,
against a random upstream gradient, and names what a failing gradient looks
like. Here the op is a softmax over the last axis, and the first backward
has a classic slip: it forgets the row sum of the closed form
``dx = P * (dP - sum(P * dP, axis=-1))``.
"""
import numpy as np

from qkvnp.gradcheck import check_op


def softmax_forward(x):
    shifted = np.exp(x - x.max(axis=-1, keepdims=True))
    out = shifted / shifted.sum(axis=-1, keepdims=True)
    return out, out  # the cache is what backward reads: the weights P


def softmax_backward_buggy(dout, weights):
    return weights * dout  # the row-sum term is missing


def softmax_backward(dout, weights):
    return weights * (dout - np.sum(weights * dout, axis=-1, keepdims=True))


x = {"x": np.random.default_rng(0).standard_normal((3, 5))}

report = check_op(softmax_forward, softmax_backward_buggy, x)
print(report.table())
row = report.row("x")
print("\nok:", report.ok, "| worst entry", row.worst_index, "| diagnosis:", row.diagnosis)
print(row.detail)

# %%
# The diagnosis points at the softmax's reduction. With the row sum back in
# place the check passes; what error is left is the central difference's,
# not the backward's (see :doc:`/gradcheck`).
report = check_op(softmax_forward, softmax_backward, x)
print(report.table())

# %%
# Complex step differentiates without subtracting, so it certifies the
# backward to round-off (about 1e-15). It needs a forward written for
# complex input (``np.exp`` is; ``max`` is not, so shift by the real part).


def softmax_forward_complex(x):
    shifted = np.exp(x - x.real.max(axis=-1, keepdims=True))
    out = shifted / shifted.sum(axis=-1, keepdims=True)
    return out, out


softmax_forward_complex.supports_complex_step = True
report = check_op(softmax_forward_complex, softmax_backward, x, method="complex_step")
print(report.table())
