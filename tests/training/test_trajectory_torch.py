"""Trajectory parity with autograd: qkvnp's training loop against PyTorch, 100 steps.

Oracle: the kv-recall model rebuilt from torch ops (embedding lookups,
matmuls, softmax, ``F.cross_entropy``), differentiated by torch autograd and
updated by ``torch.optim``, starting from the same initial weights and fed
the same batches. In float64 the loss of every one of 100 steps agrees with
the loss :func:`qkvnp.training.loop.train` records to a relative 1e-9, for SGD with
momentum and for Adam; the final parameters agree too.
"""
import math

import numpy as np
import pytest

from qkvnp.training.tasks import make_streams
from qkvnp.training.loop import TrainConfig, build_model, build_task, train

STEPS = 100
CONFIG = dict(num_keys=16, num_values=16, num_pairs=6, dim=16, batch_size=32, steps=STEPS,
              schedule="constant", eval_size=64, seed=3)


def torch_kv_recall_logits(torch, weights, roles, batch, dim):
    """The forward of :class:`qkvnp.training.models.KVRecallModel`, in torch ops."""
    keys, values, query = (torch.from_numpy(a) for a in (batch.keys, batch.values, batch.query))
    P = keys.shape[1]
    tokens = torch.cat([keys, query[:, None]], dim=1)  # (B, P+1)
    key_vectors = weights["embed_key.weight"][tokens]  # (B, P+1, E)
    items = key_vectors[:, :P] + weights["embed_value.weight"][values]  # (B, P, E)
    query_token = key_vectors[:, P:] + weights["query_marker"]  # (B, 1, E)
    role_q, role_k, role_v = roles
    q = query_token @ weights[role_q]
    k = items @ weights[role_k]
    v = items if role_v is None else items @ weights[role_v]
    scores = q @ k.transpose(-1, -2) / math.sqrt(dim)  # (B, 1, P)
    attended = torch.softmax(scores, dim=-1) @ v  # (B, 1, E)
    return attended[:, 0] @ weights["readout.W"] + weights["readout.b"]  # (B, V)


def torch_losses(torch, config, make_optimizer):
    """Losses of STEPS torch steps from qkvnp's initial weights and batches."""
    config = config.resolved()
    streams = make_streams(config.seed)
    task = build_task(config, streams.teacher)
    model = build_model(config, streams.init)  # the initial weights qkvnp starts from
    weights = {name: torch.tensor(value, dtype=torch.float64, requires_grad=True)
               for name, value in model.params.items()}
    optimizer = make_optimizer(list(weights.values()))
    losses = []
    for _ in range(STEPS):
        batch = task.sample(streams.data, config.batch_size)  # the same stream train() draws
        optimizer.zero_grad()
        logits = torch_kv_recall_logits(torch, weights, model.roles, batch, config.dim)
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(batch.target))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return np.array(losses), {name: w.detach().numpy() for name, w in weights.items()}


@pytest.mark.parametrize("optimizer, variant, make", [
    # SGD with momentum 0.9 (torch's buffer rule: b_1 = g_1, b_t = mu b + g)
    ("sgd", "separate", lambda torch, p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    # Adam, default betas and eps
    ("adam", "separate", lambda torch, p: torch.optim.Adam(p, lr=5e-3)),
    # a tied matrix: torch autograd sums the gradients of W_qk's two uses
    ("adam", "tied_qk", lambda torch, p: torch.optim.Adam(p, lr=5e-3)),
])
def test_loss_trajectory_matches_pytorch(torch, optimizer, variant, make):
    config = TrainConfig(optimizer=optimizer, variant=variant, **CONFIG)
    result = train(config)
    ours = np.array(result.history["loss"])
    theirs, torch_params = torch_losses(torch, config, lambda p: make(torch, p))
    assert ours.shape == theirs.shape == (STEPS,)
    assert theirs[-1] < 0.5 * theirs[0]  # the run does learn: the comparison is not of a flat line
    relative = np.abs(ours - theirs) / np.abs(theirs)
    worst = int(np.argmax(relative))
    assert relative.max() <= 1e-9, (
        f"step {worst + 1}: qkvnp loss {ours[worst]!r}, torch loss {theirs[worst]!r}, "
        f"relative {relative[worst]:.2e}")
    for name, value in result.model.params.items():
        np.testing.assert_allclose(value, torch_params[name], rtol=1e-7, atol=1e-9, err_msg=name)
