"""LoRA on a Decoder loaded from transformers, against torch autograd of the same formula.

Oracle: transformers' own model (float64, eager, its float32 spots patched as
``tests/test_interop_hf.py`` does, whose fixture this reuses) with
``q_proj`` and ``v_proj`` wrapped in a torch module computing
``base(x) + (alpha / r) (x A) B`` from the same ``A`` and ``B``: the logits
and the adapters' gradients of a cross-entropy loss to 1e-10, with left
padding. GPT-2 is left out: its attention is one fused ``c_attn``, so its
projections have no ``q_proj`` to adapt in transformers.
"""
from __future__ import annotations

import numpy as np
import pytest

from qkvnp.interop import from_hf
from qkvnp.layers import adapter_grads, adapter_params, apply_lora
from test_interop_hf import V, _loss_grad, hf_float64  # noqa: F401  (a fixture)

FAMILIES = ("llama", "mistral", "qwen3", "qwen3_moe", "gemma3_text")


def _torch_lora(torch, base, A, B, scale):
    class LoRA(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base = base
            self.A = torch.nn.Parameter(torch.tensor(A))
            self.B = torch.nn.Parameter(torch.tensor(B))

        def forward(self, x):
            return self.base(x) + scale * (x @ self.A) @ self.B

    return LoRA()


@pytest.mark.parametrize("family", FAMILIES)
def test_adapted_logits_and_adapter_gradients_match_torch_autograd(torch, hf_float64, family):
    hf = hf_float64(family, seed=3)
    model = from_hf(hf)
    names = apply_lora(model, ["q_proj", "v_proj"], rank=3, alpha=6.0, rng=4)
    rng = np.random.default_rng(5)
    for key, value in adapter_params(model).items():
        if key.endswith(".B"):  # away from zero, so that A's gradient is not 0
            value[...] = 0.2 * rng.standard_normal(value.shape)
    wrapped = {}
    layers = dict(model.named_layers())
    for name in names:  # blocks.<i>.self_attn.<proj>
        _, i, _, proj = name.split(".")
        attention = hf.model.layers[int(i)].self_attn
        lora = _torch_lora(torch, getattr(attention, proj), layers[name].params["A"],
                           layers[name].params["B"], layers[name].scale)
        setattr(attention, proj, lora)
        wrapped[name] = lora
    ids = rng.integers(3, V, size=(2, 7))
    mask = np.array([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    targets = rng.integers(0, V, size=ids.shape)
    logits = model.forward(ids, attention_mask=mask)
    model.backward(_loss_grad(logits, targets, mask.astype(float)))

    hf_logits = hf(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    labels = torch.tensor(np.where(mask > 0, targets, -100))
    torch.nn.functional.cross_entropy(hf_logits.reshape(-1, V), labels.reshape(-1),
                                      ignore_index=-100).backward()
    real = mask > 0
    np.testing.assert_allclose(logits[real], hf_logits.detach().numpy()[real], rtol=0, atol=1e-10)
    grads = adapter_grads(model)
    assert sorted(grads) == sorted(f"{name}.{part}" for name in names for part in "AB")
    for name, lora in wrapped.items():
        for part in "AB":
            np.testing.assert_allclose(grads[f"{name}.{part}"], getattr(lora, part).grad.numpy(),
                                       rtol=0, atol=1e-10, err_msg=f"{name}.{part}")
