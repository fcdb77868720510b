"""The reference ops: the textbook, one concept a module, each a pure forward and its backward.

Every differentiable op is a pair of functions, a forward returning
``(out, cache)`` and a backward taking ``(dout, cache)``, written as the math
reads (the derivations are in ``docs/derivations.md``). They import nothing
from the kernels, the layers, the models or the apps: they are the oracle
the faster paths are tested against. Users reach them through
:mod:`qkvnp.functional`.

==================  ===========================================================
``linear``          the affine map ``x @ W + b``
``softmax``         softmax along an axis, its closed-form backward
``attention``       scaled dot-product attention, the backward's derivation
``masks``           mask checks, the causal masks, fill values from the dtype
``overflow``        products near the float maximum, exact or clipped
``dropout``         dropout on the attention weights (arguments, masks) and on activations
``gqa``             grouped-query attention as broadcasting
``heads``           splitting the embedding into heads and merging them back
``embedding``       the row lookup and its scatter-add backward
``reductions``      the adjoints of broadcasting
``positions``       ALiBi's and T5's position biases
``variants``        RoPE, score biases, soft-caps, sinks and windows
``layer_norm``      layer normalisation over the last axis
``gelu``            the GELU activation, tanh or exact
``residual``        the residual add
``losses``          mean squared error, softmax cross-entropy, accuracy
``moe``             a mixture of experts' router, its gates and its load-balancing loss
``topk``            the top-k indices in ``torch.topk``'s CPU order, ties included
==================  ===========================================================
"""

__all__: list = []
