"""Tests of the training step's ceiling (train_ceiling.py, workloads/torch_kernels.py): untimed, tiny.

Oracles: qkvnp's own step (the same weights, data and optimizer) for the
step with torch's kernels, to float32 rounding; the rewritten module's
syntax tree, which must hold no numpy product; the command's own check of
the first losses against transformers', which decides its exit status.
"""
import ast
import inspect
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                os.pardir, os.pardir)))
torch = pytest.importorskip("torch")

from benchmarks import train_ceiling  # noqa: E402
from benchmarks.workloads import torch_kernels  # noqa: E402
from benchmarks.workloads.families import TINY, make_runner  # noqa: E402


@pytest.fixture
def runners():
    """``make(library)``: a training runner on TINY; the thread counts each one holds for
    a worker's life are let go at the end, the last made first."""
    made = []

    def make(library, threads=1):
        made.append(make_runner(library, "train", TINY, threads=threads))
        return made[-1]

    yield make
    for runner in reversed(made):
        getattr(runner, "runner", runner).pinned.close()


def _numpy_products(tree):
    """The ``@`` and ``np.matmul`` nodes of a syntax tree."""
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult)
            or isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "matmul"]


def test_rewrite_leaves_no_numpy_product():
    import qkvnp.kernels.decoder_train as original

    tree = ast.parse(inspect.getsource(original))
    found = len(_numpy_products(tree))
    rewrite = torch_kernels._TorchProducts()
    rewritten = rewrite.visit(tree)
    assert found >= 10 and rewrite.count == found
    assert _numpy_products(rewritten) == []


@pytest.mark.parametrize("library", ["qkvnp+torch-mm-sdpa", "qkvnp+torch-mm-sdpa-silu"])
@pytest.mark.parametrize("threads", [1, 2])
def test_step_with_torch_kernels_equals_qkvnps_step(library, threads, runners):
    """Oracle: qkvnp's own step from the same weights: the same losses over three AdamW
    steps and the same gradients, to float32 rounding; the real module is left as it was."""
    import qkvnp.kernels.decoder_train as original

    before = original.stack_forward, original.stack_backward
    mine, theirs = runners("qkvnp", threads), runners(library, threads)
    calls = {"forward": 0}
    forward = theirs.module.stack_forward

    def counted(*args, **kwargs):
        calls["forward"] += 1
        return forward(*args, **kwargs)

    theirs.module.stack_forward = counted
    mine_losses = [mine.call() for _ in range(3)]
    theirs_losses = [theirs.call() for _ in range(3)]
    assert calls["forward"] == 3  # the rewritten blocks ran
    assert (original.stack_forward, original.stack_backward) == before
    np.testing.assert_allclose(theirs_losses, mine_losses, rtol=1e-5)
    for name, grad in mine.model.grads.items():
        np.testing.assert_allclose(theirs.runner.model.grads[name], grad, rtol=1e-3,
                                   atol=1e-5 * np.abs(grad).max(), err_msg=name)


def test_step_without_guarantees_computes_the_same_bits_and_restores_everything(runners):
    """Oracle: the same step with the guarantees: what they cost changes no value (the
    copies, the fresh zeros and the tests), so the same losses and gradients, bit for bit;
    after each step every patched name is back."""
    import qkvnp.kernels.decoder_train as kernel
    from qkvnp.layers import base, transaction

    before = (kernel.block_weights, kernel.stack_backward, transaction._Transaction.commit,
              base.Layer.zero_grad, base.Model.zero_grad)
    guarded = runners("qkvnp+torch-mm-sdpa-silu")
    unguarded = runners("qkvnp+torch-mm-sdpa-silu-unguarded")
    loss_forward = unguarded.runner.loss_forward
    for _ in range(3):
        assert unguarded.call() == guarded.call()
        assert (kernel.block_weights, kernel.stack_backward, transaction._Transaction.commit,
                base.Layer.zero_grad, base.Model.zero_grad) == before
        assert unguarded.runner.loss_forward is loss_forward
    for name, grad in guarded.runner.model.grads.items():
        np.testing.assert_array_equal(unguarded.runner.model.grads[name], grad, err_msg=name)


def test_unguarded_commit_sums_a_tied_tables_two_gradients():
    """Oracle: the guarded step of the same tied model: the embedding table gets its lookup's
    and the head's gradients, the same sum in the same order, bit for bit."""
    import contextlib
    import types

    from qkvnp.losses import cross_entropy_backward, cross_entropy_forward
    from qkvnp.models.decoder import Decoder, DecoderConfig

    c = TINY
    config = DecoderConfig.qwen3(
        vocab_size=c["vocab_size"], emb_dim=c["hidden_size"], num_layers=1,
        num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"], hidden_dim=c["intermediate_size"], context_length=16,
        tie_embeddings=True)
    ids = np.random.default_rng(0).integers(0, c["vocab_size"], (2, 8))
    grads = []
    for guarded in (True, False):
        model = Decoder(config, rng=0, dtype=np.float32)
        runner = types.SimpleNamespace(loss_forward=cross_entropy_forward)
        with contextlib.nullcontext() if guarded else torch_kernels.without_guarantees(runner):
            model.zero_grad()
            loss, cache = runner.loss_forward(model.forward(ids), ids)
            model.backward(cross_entropy_backward(1.0, cache))
        grads.append(model.grads)
    assert "embed.weight" in grads[0] and not any("head" in name for name in grads[0])
    for name, grad in grads[0].items():
        np.testing.assert_array_equal(grads[1][name], grad, err_msg=name)


def test_unknown_runner_is_refused(runners):
    with pytest.raises(ValueError, match="unknown library"):
        runners("qkvnp+torch-mm-sdpa-gelu")


def test_attention_stand_in_refuses_other_masks():
    module = torch_kernels.torch_kernels_module(torch)
    q = np.zeros((1, 2, 4, 8), np.float32)
    keep = np.ones((4, 4), bool)  # no causal mask
    with pytest.raises(ValueError, match="causal mask only"):
        module.fast_attention_forward(q, q[:, :1], q[:, :1], keep, False, 0.125, enable_gqa=True)


def test_silu_stand_in_refuses_other_activations():
    module = torch_kernels.torch_kernels_module(torch, silu=True)
    with pytest.raises(ValueError, match="SiLU only"):
        module.gated_forward_fused(np.zeros((2, 4), np.float32), "gelu_tanh")


def test_tiny_run_agrees_and_prints_each_step(capsys):
    pytest.importorskip("transformers")
    args = ["--tiny", "--threads", "1", "--repeats", "1", "--warmup", "0", "--pause", "0",
            "--round-time", "0.001"]
    assert train_ceiling.main(args) == 0
    out = capsys.readouterr().out
    for label in train_ceiling.RUNNERS.values():
        assert label.strip() in out
