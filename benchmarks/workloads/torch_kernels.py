"""qkvnp's decoder training step with torch's products and attention kernel in numpy's place (a ceiling).

Shape key: b a share's batch, H query heads, K key/value heads, T queries,
S keys, D head dim.

:func:`torch_kernels_module` rebuilds ``qkvnp.kernels.decoder_train`` from
its own source with an AST rewrite: each ``a @ b`` and ``np.matmul(a, b,
out=...)`` becomes ``torch.matmul`` on the same arrays (MKL, no copy), and
its attention core, forward and backward, becomes torch's fused
flash-attention kernel for the CPU
(``aten::_scaled_dot_product_flash_attention_for_cpu``, what transformers'
SDPA step runs), each key/value head repeated for its group of query heads
as transformers' ``repeat_kv`` does, and the group's gradients summed back.
Optionally, its gated activation becomes torch's SiLU (``silu(gate) * up``,
forward and backward). Everything else in the module, and everything around
it (the norms, RoPE, the batch shares on the worker threads, the loss,
AdamW, the checks and copies), stays qkvnp's code as it stands.

:class:`TorchKernelsRunner` runs the families benchmark's training step
with that module in place of the real one, torch at one thread in each
share (as numpy's BLAS is there); ``make_runner("qkvnp+torch-mm-sdpa",
...)`` builds it, ``"qkvnp+torch-mm-sdpa-silu"`` with torch's SiLU, and
``"qkvnp+torch-mm-sdpa-silu-unguarded"`` also without what qkvnp's
guarantees cost (:class:`without_guarantees`: no copies of the weights for
the backward, no fresh zeros for the gradients, no finiteness tests). Only
for measuring: ``benchmarks/train_ceiling.py``.
"""
import ast
import inspect
import types

import numpy as np

__all__ = ["torch_kernels_module", "TorchKernelsRunner", "without_guarantees"]


class _TorchProducts(ast.NodeTransformer):
    """``a @ b`` and ``np.matmul(a, b[, out=])`` -> ``_torch_matmul(a, b[, out=])``; counts them."""

    def __init__(self):
        self.count = 0

    def visit_BinOp(self, node):
        self.generic_visit(node)
        if not isinstance(node.op, ast.MatMult):
            return node
        self.count += 1
        call = ast.Call(ast.Name("_torch_matmul", ast.Load()), [node.left, node.right], [])
        return ast.copy_location(call, node)

    def visit_Call(self, node):
        self.generic_visit(node)
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr == "matmul"
                and isinstance(func.value, ast.Name) and func.value.id == "np"):
            self.count += 1
            node.func = ast.copy_location(ast.Name("_torch_matmul", ast.Load()), func)
        return node


def torch_kernels_module(torch, silu=False):
    """``qkvnp.kernels.decoder_train`` rebuilt from its source with torch's products and attention core,
    and with ``silu`` torch's SiLU for the gated activation (``silu(gate) * up`` and its backward)."""
    import qkvnp.kernels.decoder_train as original

    rewrite = _TorchProducts()
    tree = ast.fix_missing_locations(rewrite.visit(ast.parse(inspect.getsource(original))))
    if rewrite.count < 10:  # the blocks' and the head's products, forward and backward
        raise RuntimeError(f"only {rewrite.count} products found in {original.__file__}")
    module = types.ModuleType(original.__name__ + "_with_torch_kernels")
    module.__package__ = original.__package__  # its relative imports
    exec(compile(tree, original.__file__, "exec"), module.__dict__)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    def torch_matmul(a, b, out=None):
        product = torch.matmul(torch.from_numpy(a), torch.from_numpy(b),
                               out=None if out is None else torch.from_numpy(out))
        return product.numpy() if out is None else out

    def attention_forward(query, key, value, keep, is_causal, scale, enable_gqa=False):
        T, S = query.shape[-2], key.shape[-2]
        if keep is None or not (np.asarray(keep) == np.tri(T, S, dtype=bool)).all():
            raise ValueError("torch's kernel stands in for the causal mask only")
        groups = query.shape[1] // key.shape[1]  # (b, H, T, D) queries, (b, K, S, D) keys
        q, k, v = (torch.from_numpy(a) for a in (query, key, value))
        if groups > 1:  # (b, K, S, D) -> (b, H, S, D), as transformers' repeat_kv
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        out, logsumexp = flash(q, k, v, 0.0, True, scale=scale)
        return out.numpy(), (q, k, v, out, logsumexp, scale, groups)

    def attention_backward(dout, cache):
        q, k, v, out, logsumexp, scale, groups = cache
        dq, dk, dv = flash_backward(torch.from_numpy(dout), q, k, v, out, logsumexp, 0.0, True,
                                    scale=scale)
        if groups > 1:  # (b, H, S, D) -> (b, K, S, D): each group's sum
            b, H, S, D = dk.shape
            dk = dk.view(b, H // groups, groups, S, D).sum(2)
            dv = dv.view(b, H // groups, groups, S, D).sum(2)
        return dq.numpy(), dk.numpy(), dv.numpy()

    def gated_forward(gate_up, activation):
        if activation != "silu":
            raise ValueError(f"torch's kernel stands in for SiLU only, not {activation!r}")
        F = gate_up.shape[1] // 2
        gate, up = torch.from_numpy(gate_up[:, :F]), torch.from_numpy(gate_up[:, F:])  # (N, F) views
        act = torch.nn.functional.silu(gate)
        return (act * up).numpy(), (gate, up, act)

    def gated_backward(dhidden, cache):
        gate, up, act = cache
        dgate_up = np.empty((dhidden.shape[0], 2 * dhidden.shape[1]), dhidden.dtype)  # (N, 2F)
        F = dhidden.shape[1]
        dh = torch.from_numpy(dhidden)
        torch.mul(dh, act, out=torch.from_numpy(dgate_up[:, F:]))  # d up = dh act
        torch.ops.aten.silu_backward.grad_input(dh * up, gate, grad_input=torch.from_numpy(dgate_up[:, :F]))
        return dgate_up

    module._torch_matmul = torch_matmul
    if silu:
        module.gated_forward_fused, module.gated_backward_fused = gated_forward, gated_backward
    module.fast_attention_forward = attention_forward
    module.fast_attention_backward = attention_backward
    return module


class TorchKernelsRunner:
    """A qkvnp training runner whose steps run :func:`torch_kernels_module` in place of the real module.

    ``runner``: the families benchmark's qkvnp runner (its model, data and
    optimizer); ``silu``: torch's SiLU too; ``guarantees=False``: its steps
    also go without what qkvnp's guarantees cost (:func:`without_guarantees`).
    torch runs at one thread for the worker's life.
    """

    def __init__(self, runner, silu=False, guarantees=True):
        import torch

        torch.set_num_threads(1)  # one thread in each share, as numpy's BLAS there
        self.runner, self.module = runner, torch_kernels_module(torch, silu)
        self.guarantees, self.library = guarantees, self.name(silu, guarantees)
        self.task, self.data = runner.task, runner.data

    @staticmethod
    def name(silu, guarantees):
        """The runner's library name, for ``make_runner``."""
        return "qkvnp+torch-mm-sdpa" + ("-silu" if silu else "") + ("" if guarantees else "-unguarded")

    def call(self):
        import contextlib

        import qkvnp.kernels.decoder_train as original

        saved = original.stack_forward, original.stack_backward
        original.stack_forward = self.module.stack_forward
        original.stack_backward = self.module.stack_backward
        try:
            with contextlib.nullcontext() if self.guarantees else without_guarantees(self.runner):
                return self.runner.call()
        finally:
            original.stack_forward, original.stack_backward = saved


class without_guarantees:
    """A context in which a qkvnp training runner's step goes without what its guarantees cost.

    NOT a way to train: only a measure of those costs. Inside it:

    - the blocks' weights are not copied for the backward (only the joined
      projections are made, as the products need them): an optimizer step
      between a forward and its backward would change the gradients;
    - ``zero_grad`` does nothing, and the transaction's commit puts each
      parameter's first kept gradient in place of the old array (a
      C-contiguous copy of a view) and adds any later one into it, instead
      of adding them into fresh zeros, as torch's
      ``zero_grad(set_to_none=True)`` and its accumulation do: an array of
      ``grads`` that a caller kept is no longer the model's;
    - the logits and ``dlogits`` are not tested finite.
    """

    def __init__(self, runner):
        self.runner = runner

    def __enter__(self):
        import qkvnp.kernels.decoder_train as kernel
        from qkvnp.kernels.loss import cross_entropy_probs_fused
        from qkvnp.layers import base, transaction
        from qkvnp.ops.losses import CrossEntropyCache, cross_entropy_inputs

        def block_weights(params, spec):
            p, qk = params, spec["qk_norm"]
            return kernel.BlockWeights(
                p["attn_norm.weight"], p["mlp_norm.weight"],
                p["self_attn.q_norm.weight"] if qk else None,
                p["self_attn.k_norm.weight"] if qk else None,
                np.concatenate([p[f"self_attn.{n}_proj.W"] for n in "qkv"], axis=1),
                p["self_attn.o_proj.W"],
                np.concatenate([p["mlp.gate_proj.W"], p["mlp.up_proj.W"]], axis=1),
                p["mlp.down_proj.W"], dict(spec))

        def commit(transaction_self):
            placed = set()  # (owner, name) given a gradient this step: a tied table's second adds
            for owner, attribute, name, grad in transaction_self.grads:
                grads = getattr(owner, attribute)
                if (id(owner), name) in placed:  # a new sum: the placed array may be a view
                    grads[name] = grads[name] + grad
                else:
                    grads[name] = np.ascontiguousarray(grad)
                    placed.add((id(owner), name))

        def zero_grad(layer):
            pass

        def loss_forward(logits, targets):
            logits, targets, counted, count = cross_entropy_inputs(logits, targets, None, None,
                                                                   finite=False)
            loss, probs = cross_entropy_probs_fused(logits, targets, counted, count)
            return loss, CrossEntropyCache(probs, targets, counted, count)

        stack_backward = kernel.stack_backward

        def unchecked_backward(dout, cache, finite_name=None):
            return stack_backward(dout, cache, None)

        self.saved = [(kernel, "block_weights"), (kernel, "stack_backward"),
                      (transaction._Transaction, "commit"), (base.Layer, "zero_grad"),
                      (base.Model, "zero_grad"), (self.runner, "loss_forward")]
        self.saved = [(owner, name, getattr(owner, name)) for owner, name in self.saved]
        kernel.block_weights, kernel.stack_backward = block_weights, unchecked_backward
        transaction._Transaction.commit = commit
        base.Layer.zero_grad = base.Model.zero_grad = zero_grad
        self.runner.loss_forward = loss_forward
        return self

    def __exit__(self, *exc):
        for owner, name, value in self.saved:
            setattr(owner, name, value)
        return False
