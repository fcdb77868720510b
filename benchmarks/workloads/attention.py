"""The workloads timed: their inputs, and one runner per implementation of each.

Shape key: B batch, L sequence length (queries and keys alike), E embedding,
H heads, D = E // H head dim.

For a configuration, dtype and mask, two workloads, each in two modes,
``fwd`` (the forward of a training step: qkvnp keeps its caches, PyTorch
records the autograd graph) and ``fwd+bwd`` (that forward, then the backward
with a fixed random upstream gradient):

``layer``
    Self-attention of ``x`` of shape (B, L, E) through
    ``MultiHeadAttention(E, H, bias=True, impl=NAME)`` for each qkvnp
    implementation ``reference``, ``fast``, ``tiled`` and ``auto`` (the
    layers' default, which picks fast or tiled), and through PyTorch's
    ``nn.MultiheadAttention(E, H, batch_first=True)`` called with
    ``need_weights=False``. The weights are copied across, so that all of
    them compute the same function. Causal: qkvnp's ``is_causal=True``;
    PyTorch gets the float causal mask with ``is_causal=True``, which with
    ``need_weights=False`` reaches ``scaled_dot_product_attention`` as its
    causal hint.
``core``
    The attention core alone on (B, H, L, D) inputs, no projections:
    ``attention_forward``/``attention_backward`` of ``qkvnp.functional``
    (reference), ``qkvnp.kernels.fast`` and ``qkvnp.kernels.tiled``, against
    ``torch.nn.functional.scaled_dot_product_attention``.

An implementation that this qkvnp does not offer (a module that does not
import, a layer that refuses the ``impl=`` name) or that PyTorch's absence
rules out raises :class:`ImplementationMissing`; the harness reports it as
missing and runs the others.
"""
from collections import namedtuple

import numpy as np

from benchmarks.workloads.grid import KIND_IMPLEMENTATIONS, KINDS, check_config, check_dtype
from qkvnp import MultiHeadAttention

__all__ = [
    "TORCH_MISSING",
    "ImplementationMissing",
    "import_torch",
    "LAYER_PARAMS",
    "CORE_MODULES",
    "Problem",
    "make_problem",
    "make_runner",
]

#: Why the PyTorch columns are empty when it is absent (the hint every
#: message of the repository gives: tests/test_packaging.py checks them).
TORCH_MISSING = "PyTorch is not installed (pip install 'qkvnp[torch]')"

LAYER_PARAMS = ("W_query", "W_key", "W_value", "W_out", "b_query", "b_key", "b_value", "b_out")
CORE_MODULES = {"reference": "qkvnp.functional", "fast": "qkvnp.kernels.fast",
                "tiled": "qkvnp.kernels.tiled"}


class ImplementationMissing(Exception):
    """This qkvnp (or this machine) does not offer the implementation."""


Problem = namedtuple("Problem", "kind config dtype arrays causal", defaults=(False,))
Problem.__doc__ = ("A workload's concrete inputs: kind, Config, dtype, dict of arrays, and "
                   "whether the attention is causal.")


def make_problem(kind, config, dtype, seed=0, causal=False):
    """Build the inputs of one workload, reproducibly.

    Parameters
    ----------
    kind : {"layer", "core"}
    config : Config or tuple (B, L, E, H)
    dtype : float32 or float64
    seed : int
    causal : bool
        Every implementation then attends causally (position i to keys <= i).

    Returns
    -------
    Problem
        ``layer``: ``x`` and ``dout`` of shape (B, L, E), the weights
        ``W_*`` (E, E) (Xavier uniform) and biases ``b_*`` (E,) (small,
        nonzero so that their gradients are checked). ``core``: ``query``,
        ``key``, ``value`` and ``dout`` of shape (B, H, L, D). Entries are
        standard normal unless said otherwise.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    config = check_config(config)
    dtype = check_dtype(dtype)
    rng = np.random.default_rng(seed)
    B, L, E, H = config
    if kind == "layer":
        arrays = {
            "x": rng.standard_normal((B, L, E), dtype=dtype),
            "dout": rng.standard_normal((B, L, E), dtype=dtype),
        }
        bound = np.sqrt(6.0 / (E + E))
        for name in LAYER_PARAMS:
            if name.startswith("W_"):
                arrays[name] = rng.uniform(-bound, bound, (E, E)).astype(dtype)
            else:
                arrays[name] = (0.1 * rng.standard_normal(E)).astype(dtype)
    else:
        shape = (B, H, L, E // H)
        arrays = {name: rng.standard_normal(shape, dtype=dtype)
                  for name in ("query", "key", "value", "dout")}
    return Problem(kind, config, dtype, arrays, bool(causal))


# ---------------------------------------------------------------- runners
# A runner owns one implementation set up on one problem. forward() and
# forward_backward() are what is timed; result() returns the output and every
# gradient, computed afresh, as a dict of numpy arrays for the cross-check.


def import_torch():
    """The ``torch`` module; :class:`ImplementationMissing` (:data:`TORCH_MISSING`) if absent."""
    try:
        import torch
    except ImportError:
        raise ImplementationMissing(TORCH_MISSING) from None
    return torch  # NOTE: at its default thread count, as users get it


class _QkvnpLayer:
    library = "qkvnp"

    def __init__(self, impl, problem):
        B, L, E, H = problem.config
        try:
            self.layer = MultiHeadAttention(E, H, bias=True, rng=0, dtype=problem.dtype, impl=impl)
        except (ValueError, TypeError) as error:
            if "impl" in str(error):
                raise ImplementationMissing(f"MultiHeadAttention(impl={impl!r}): {error}") from None
            raise
        for name in LAYER_PARAMS:
            np.copyto(self.layer.params[name], problem.arrays[name])
        self.layer.zero_grad()
        self.x = problem.arrays["x"]
        self.dout = problem.arrays["dout"]
        self.causal = problem.causal

    @property
    def dispatch(self):
        """The path the layer's last forward ran and why, as a dict (None before one)."""
        last = self.layer.last_dispatch
        return None if last is None else {"path": last.path, "reason": last.reason}

    def forward(self):
        return self.layer.forward(self.x, is_causal=self.causal)

    def forward_backward(self):
        self.layer.forward(self.x, is_causal=self.causal)
        return self.layer.backward(self.dout)

    def result(self):
        self.layer.zero_grad()
        out = self.layer.forward(self.x, is_causal=self.causal)
        dx = self.layer.backward(self.dout)
        results = {"out": out, "dx": dx}
        results.update(("d" + name, self.layer.grads[name].copy()) for name in LAYER_PARAMS)
        self.layer.zero_grad()
        return results


class _QkvnpCore:
    library = "qkvnp"

    def __init__(self, impl, problem):
        import importlib

        module_name = CORE_MODULES[impl]
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ImplementationMissing(f"{module_name} does not import: {error}") from None
        try:
            self.attention_forward = module.attention_forward
            self.attention_backward = module.attention_backward
        except AttributeError as error:
            raise ImplementationMissing(f"{module_name}: {error}") from None
        self.query = problem.arrays["query"]
        self.key = problem.arrays["key"]
        self.value = problem.arrays["value"]
        self.dout = problem.arrays["dout"]
        self.causal = problem.causal

    def forward(self):
        return self.attention_forward(self.query, self.key, self.value, is_causal=self.causal)[0]

    def forward_backward(self):
        out, cache = self.attention_forward(self.query, self.key, self.value, is_causal=self.causal)
        return self.attention_backward(self.dout, cache)

    def result(self):
        out, cache = self.attention_forward(self.query, self.key, self.value, is_causal=self.causal)
        dquery, dkey, dvalue = self.attention_backward(self.dout, cache)
        return {"out": out, "dquery": dquery, "dkey": dkey, "dvalue": dvalue}


class _TorchLayer:
    library = "torch"

    def __init__(self, problem):
        torch = import_torch()
        B, L, E, H = problem.config
        a = problem.arrays
        tensor = torch.from_numpy
        self.torch = torch
        self.mha = torch.nn.MultiheadAttention(
            E, H, bias=True, batch_first=True, dtype=getattr(torch, problem.dtype.name)
        )
        with torch.no_grad():
            # PyTorch stores the transposes of qkvnp's x @ W weights
            in_proj = np.concatenate([a["W_query"].T, a["W_key"].T, a["W_value"].T])  # -> (3E, E)
            self.mha.in_proj_weight.copy_(tensor(in_proj))
            self.mha.in_proj_bias.copy_(tensor(np.concatenate([a["b_query"], a["b_key"], a["b_value"]])))
            self.mha.out_proj.weight.copy_(tensor(np.ascontiguousarray(a["W_out"].T)))
            self.mha.out_proj.bias.copy_(tensor(a["b_out"]))
        self.x = tensor(a["x"]).requires_grad_()
        self.dout = tensor(a["dout"])
        self.leaves = [self.x] + list(self.mha.parameters())
        self.masks = {}
        if problem.causal:
            # NOTE: the float mask with the is_causal hint, as PyTorch documents it:
            # with need_weights=False it reaches scaled_dot_product_attention as
            # is_causal=True, and the mask itself is not applied
            self.masks = {"attn_mask": torch.nn.Transformer.generate_square_subsequent_mask(
                L, dtype=self.mha.in_proj_weight.dtype), "is_causal": True}

    def forward(self):
        # query is key is value: PyTorch takes its packed in-projection path
        return self.mha(self.x, self.x, self.x, need_weights=False, **self.masks)[0]

    def forward_backward(self):
        for leaf in self.leaves:
            leaf.grad = None
        self.forward().backward(self.dout)

    def result(self):
        for leaf in self.leaves:
            leaf.grad = None
        out = self.forward()
        out.backward(self.dout)
        E = self.x.shape[-1]
        weight_grad = self.mha.in_proj_weight.grad.numpy()
        bias_grad = self.mha.in_proj_bias.grad.numpy()
        results = {"out": out.detach().numpy(), "dx": self.x.grad.numpy()}
        for i, name in enumerate(("query", "key", "value")):
            results["dW_" + name] = weight_grad[i * E:(i + 1) * E].T  # (E, E) transposed back
            results["db_" + name] = bias_grad[i * E:(i + 1) * E]
        results["dW_out"] = self.mha.out_proj.weight.grad.numpy().T
        results["db_out"] = self.mha.out_proj.bias.grad.numpy()
        return results


class _TorchCore:
    library = "torch"

    def __init__(self, problem):
        torch = import_torch()
        a = problem.arrays
        self.sdpa = torch.nn.functional.scaled_dot_product_attention
        self.query = torch.from_numpy(a["query"]).requires_grad_()
        self.key = torch.from_numpy(a["key"]).requires_grad_()
        self.value = torch.from_numpy(a["value"]).requires_grad_()
        self.dout = torch.from_numpy(a["dout"])
        self.causal = problem.causal

    def forward(self):
        return self.sdpa(self.query, self.key, self.value, is_causal=self.causal)

    def forward_backward(self):
        self.query.grad = self.key.grad = self.value.grad = None
        self.forward().backward(self.dout)

    def result(self):
        self.query.grad = self.key.grad = self.value.grad = None
        out = self.forward()
        out.backward(self.dout)
        return {"out": out.detach().numpy(), "dquery": self.query.grad.numpy(),
                "dkey": self.key.grad.numpy(), "dvalue": self.value.grad.numpy()}


def make_runner(impl, problem):
    """Set up implementation ``impl`` on ``problem``.

    Parameters
    ----------
    impl : {"reference", "fast", "tiled", "auto", "torch"}
        ``"auto"`` only for the layer workload.
    problem : Problem

    Returns
    -------
    runner
        With ``library`` ("qkvnp" or "torch"), ``forward()``,
        ``forward_backward()`` (the timed calls) and ``result()`` (output and
        every gradient, as a dict of arrays, for the cross-check).

    Raises
    ------
    ImplementationMissing
        If this qkvnp does not offer ``impl`` or PyTorch is not installed.
    """
    if impl not in KIND_IMPLEMENTATIONS[problem.kind]:
        raise ValueError(f"impl must be one of {KIND_IMPLEMENTATIONS[problem.kind]} for the "
                         f"{problem.kind} workload, got {impl!r}")
    if impl == "torch":
        return _TorchLayer(problem) if problem.kind == "layer" else _TorchCore(problem)
    if problem.kind == "layer":
        return _QkvnpLayer(impl, problem)
    return _QkvnpCore(impl, problem)
