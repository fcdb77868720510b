"""llm.c's GPT-2 checkpoint files: :func:`qkvnp.interop.load_llmc` and :func:`save_llmc`.

Oracles:

- a file written here as llm.c's ``train_gpt2.py`` writes it (``write_model``,
  transcribed with numpy below: the header, then the 16 tensors of the
  ``nn.Linear`` GPT-2 in its order, the table padded to a multiple of 128),
  from a transformers ``GPT2LMHeadModel`` with random weights: read back
  exactly (``array_equal`` with ``from_hf(model, dtype=np.float32)``), and
  the loaded Decoder's logits equal transformers' to float32's rounding
  (``rtol=1e-4, atol=1e-5``: different summation orders in float32);
- bfloat16 (version 5): every value is the float32 whose top 16 bits the file
  holds (``bits << 16``), and torch's own ``bfloat16 -> float32``;
- the writer's file read back exactly, its bytes laid out as the format says;
- the book's GPTModel: its logits equal the loaded Decoder's exactly in float64
  after a float32 round trip of the weights (the same arithmetic);
- hostile files and models: one test each, refused with a message naming the
  file (or the model's option), nothing written.

llm.c's C code reading :func:`save_llmc`'s file is ``benchmarks/llmc_check.py``
(not run here: llm.c is not a dependency).
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

import qkvnp.interop.llmc as llmc
from loading_memory import HAS_VMHWM, load_growth
from qkvnp.interop import from_hf, load_llmc, save_llmc
from qkvnp.layers import apply_lora
from qkvnp.models.decoder import Decoder, DecoderConfig
from qkvnp.models.gpt import GPTModel

V, C, L, NH, MAXT = 50, 16, 2, 4, 12  # V not a multiple of 128: the padding is exercised


def gpt2(dtype=np.float32, **sizes):
    cfg = DecoderConfig.gpt2(**{**dict(vocab_size=V, emb_dim=C, num_layers=L, num_heads=NH,
                                       context_length=MAXT), **sizes})
    return Decoder(cfg, rng=0, dtype=dtype)


def header(version=3, sizes=(MAXT, V, L, NH, C, 128), magic=20240326):
    out = np.zeros(256, dtype="<i4")
    out[:8] = (magic, version, *sizes)
    return out.tobytes()


def write_model(tensors, sizes, path, dtype="float32"):
    """llm.c's ``train_gpt2.py`` ``write_model``, transcribed: ``tensors`` by its names (nn.Linear)."""
    maxT, V_, L_, NH_, C_ = sizes
    Vp = ((V_ + 127) // 128) * 128  # pad_vocab(multiple=128, value=0)
    wte = np.concatenate([tensors["transformer.wte.weight"], np.zeros((Vp - V_, C_), np.float32)])
    per_layer = ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
                 "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
                 "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"]
    order = [wte, tensors["transformer.wpe.weight"]]
    order += [tensors[f"transformer.h.{i}.{name}"] for name in per_layer for i in range(L_)]
    order += [tensors["transformer.ln_f.weight"], tensors["transformer.ln_f.bias"]]
    version = {"float32": 3, "bfloat16": 5}[dtype]
    with open(path, "wb") as f:
        f.write(header(version, (maxT, V_, L_, NH_, C_, Vp)))
        for t in order:
            t = np.ascontiguousarray(t, dtype=np.float32)
            if dtype == "bfloat16":  # torch's .to(torch.bfloat16): round to nearest even
                bits = t.view(np.uint32).astype(np.uint64)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                t = bits.astype(np.uint16)
            f.write(t.tobytes())


def hf_gpt2(transformers, torch):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=L, n_embd=C, n_head=NH, vocab_size=V,
                                     n_positions=MAXT, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so each tensor's mapping matters
        for name, value in model.named_parameters():
            value.copy_(torch.randn_like(value) * (0.3 if value.ndim == 1 else 0.1)
                        + (1.0 if "ln" in name and name.endswith("weight") else 0.0))
    return model


def llmc_tensors(model):
    """The HF model's weights as train_gpt2.py's nn.Linear GPT-2 holds them (Conv1D transposed)."""
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    return {name: (value.T if name.endswith(conv1d) else value).detach().numpy()
            for name, value in model.state_dict().items() if name != "lm_head.weight"}


def test_a_file_written_as_train_gpt2_py_does_reads_back_exactly(tmp_path, torch):
    transformers = pytest.importorskip("transformers")
    model = hf_gpt2(transformers, torch)
    path = tmp_path / "gpt2.bin"
    write_model(llmc_tensors(model), (MAXT, V, L, NH, C), path)
    loaded = load_llmc(path)
    expected = from_hf(model, dtype=np.float32)
    assert loaded.config == expected.config
    assert loaded.params.keys() == expected.params.keys()
    for name, value in expected.params.items():
        assert loaded.params[name].dtype == np.float32
        assert np.array_equal(loaded.params[name], value), name
    idx = np.random.default_rng(0).integers(0, V, size=(2, MAXT))
    with torch.no_grad():
        reference = model(torch.from_numpy(idx)).logits.numpy()
    np.testing.assert_allclose(loaded(idx), reference, rtol=1e-4, atol=1e-5)


def test_bfloat16_version_5_is_widened_exactly(tmp_path, torch):
    transformers = pytest.importorskip("transformers")
    model = hf_gpt2(transformers, torch)
    path = tmp_path / "gpt2_bf16.bin"
    write_model(llmc_tensors(model), (MAXT, V, L, NH, C), path, dtype="bfloat16")
    loaded = load_llmc(path)
    # oracle: torch's own bfloat16 rounding, then its exact widening to float32
    model_bf16 = model.to(torch.bfloat16).to(torch.float32)
    expected = from_hf(model_bf16, dtype=np.float32)
    for name, value in expected.params.items():
        assert np.array_equal(loaded.params[name], value), name


def test_bfloat16_bits_are_the_top_half_of_the_float32():
    # oracle: the definition; every bfloat16 bit pattern, with the NaNs and infinities
    bits = np.arange(2 ** 16, dtype=np.uint16)
    widened = llmc._widen(bits, np.float32)
    assert widened.dtype == np.float32
    assert np.array_equal(widened.view(np.uint32), bits.astype(np.uint32) << 16)


def test_the_writers_file_reads_back_exactly_and_is_laid_out_as_llmc_reads(tmp_path):
    model = gpt2()
    path = tmp_path / "model.bin"
    save_llmc(model, path)
    loaded = load_llmc(path)
    assert loaded.config == model.config
    for name, value in model.params.items():
        assert np.array_equal(loaded.params[name], value), name
    raw = np.fromfile(path, dtype="<i4", count=256)
    assert list(raw[:8]) == [20240326, 3, MAXT, V, L, NH, C, 128] and not raw[8:].any()
    data = np.fromfile(path, dtype="<f4", offset=1024)
    n_params = 128 * C + MAXT * C + L * (12 * C * C + 13 * C) + 2 * C
    assert data.size == n_params  # nothing after the 16 tensors
    wte = data[:128 * C].reshape(128, C)
    assert np.array_equal(wte[:V], model.params["embed.weight"]) and not wte[V:].any()
    qkvw = data[128 * C + MAXT * C + 2 * L * C:][:L * 3 * C * C].reshape(L, 3 * C, C)
    assert np.array_equal(qkvw[1, C:2 * C], model.params["blocks.1.self_attn.k_proj.W"].T)


def test_a_float64_model_is_written_rounded_to_float32_and_loads_in_float64(tmp_path):
    model = gpt2(np.float64)
    save_llmc(model, tmp_path / "m.bin")
    loaded = load_llmc(tmp_path / "m.bin", dtype=np.float64)
    for name, value in model.params.items():
        assert loaded.params[name].dtype == np.float64
        assert np.array_equal(loaded.params[name], value.astype(np.float32)), name


def test_the_books_tied_biased_gptmodel_saves_as_gpt2(tmp_path):
    book = GPTModel(V, MAXT, C, NH, L, qkv_bias=True, tie_embeddings=True, rng=1).eval()
    book.load_state_dict({name: value.astype(np.float32) for name, value in book.params.items()})
    save_llmc(book, tmp_path / "book.bin")
    loaded = load_llmc(tmp_path / "book.bin", dtype=np.float64)
    assert np.array_equal(loaded.params["blocks.1.self_attn.v_proj.b"],
                          book.params["trf_blocks.1.att.b_value"])
    idx = np.random.default_rng(0).integers(0, V, size=(2, MAXT))
    # same weights, same float64 forward (LayerNorm, tanh GELU, causal attention)
    np.testing.assert_allclose(loaded(idx), book(idx), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- hostile files


def valid_bytes():
    """A minimal valid version-3 file's bytes: V=50 padded to 128."""
    floats = 128 * C + MAXT * C + L * (12 * C * C + 13 * C) + 2 * C
    return header() + np.zeros(floats, "<f4").tobytes()


def refused(tmp_path, data, match):
    path = tmp_path / "hostile.bin"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=match) as info:
        load_llmc(path)
    assert "hostile.bin" in str(info.value)  # the message names the file


def test_a_valid_minimal_file_loads(tmp_path):  # the control of the hostile cases below
    (tmp_path / "ok.bin").write_bytes(valid_bytes())
    assert load_llmc(tmp_path / "ok.bin").config.vocab_size == V


def test_bad_magic_is_refused(tmp_path):
    refused(tmp_path, header(magic=20240327) + valid_bytes()[1024:], "magic number is 20240327")


def test_unknown_version_is_refused(tmp_path):
    refused(tmp_path, header(version=4) + valid_bytes()[1024:], "version 4")


def test_a_header_shorter_than_1024_bytes_is_refused(tmp_path):
    refused(tmp_path, header()[:600], "truncated: 600 bytes")


def test_a_truncated_file_is_refused(tmp_path):
    refused(tmp_path, valid_bytes()[:-4], "truncated")


def test_trailing_bytes_are_refused(tmp_path):
    refused(tmp_path, valid_bytes() + b"\0" * 4, "trailing bytes")


def test_channels_not_a_multiple_of_heads_are_refused(tmp_path):
    refused(tmp_path, header(sizes=(MAXT, V, L, 3, C, 128)) + valid_bytes()[1024:],
            "C=16 are not a multiple of its heads NH=3")


def test_a_padded_vocabulary_smaller_than_the_vocabulary_is_refused(tmp_path):
    refused(tmp_path, header(sizes=(MAXT, 200, L, NH, C, 128)) + valid_bytes()[1024:],
            "Vp=128 is smaller than its vocabulary V=200")


@pytest.mark.parametrize("sizes", [
    (0, V, L, NH, C, 128),       # no positions
    (MAXT, V, -1, NH, C, 128),   # negative layers
    (MAXT, V, L, NH, 0, 128),    # no channels (and C % NH would divide)
])
def test_sizes_that_are_not_positive_are_refused(tmp_path, sizes):
    refused(tmp_path, header(sizes=sizes) + valid_bytes()[1024:], "must be positive")


def test_huge_sizes_are_refused_before_anything_is_allocated(tmp_path):
    # 2**31 - 1 layers of 2**30 channels: exabytes the file does not have
    huge = (MAXT, V, 2 ** 31 - 1, 2 ** 10, 2 ** 30, 128)
    refused(tmp_path, header(sizes=huge) + valid_bytes()[1024:], r"truncated.*describes \d{20,}")


# ---------------------------------------------------------------- refused models, atomic writes


@pytest.mark.parametrize("make, match", [
    (lambda: Decoder(DecoderConfig.llama3(vocab_size=V, emb_dim=C, num_layers=1, num_heads=NH,
                                          hidden_dim=32)), "family is 'llama'"),
    (lambda: Decoder(dataclasses.replace(gpt2().config, tie_embeddings=False)),
     "tie_embeddings=False"),
    (lambda: gpt2(hidden_dim=3 * C), "hidden_dim=48"),
    (lambda: gpt2(norm_eps=1e-6), "norm_eps=1e-06"),
    (lambda: GPTModel(V, MAXT, C, NH, L, qkv_bias=True), "tie_embeddings=False"),
    (lambda: GPTModel(V, MAXT, C, NH, L, tie_embeddings=True), "qkv_bias=False"),
    (lambda: GPTModel(V, MAXT, C, NH, L, qkv_bias=True, tie_embeddings=True, rope=True),
     "variants="),
    (lambda: GPTModel(V, MAXT, C, NH, L, qkv_bias=True, tie_embeddings=True,
                      approximate="none"), "approximate='none'"),
])
def test_a_model_llmc_cannot_hold_is_refused_by_name_and_nothing_is_written(
        tmp_path, make, match):
    path = tmp_path / "out.bin"
    with pytest.raises(ValueError, match=match):
        save_llmc(make(), path)
    assert os.listdir(tmp_path) == []


def test_an_initialization_option_is_no_reason_to_refuse(tmp_path):
    # init_std sets the starting tables only: not part of what llm.c's file holds
    model = Decoder(dataclasses.replace(gpt2().config, init_std=0.5), rng=0, dtype=np.float32)
    save_llmc(model, tmp_path / "out.bin")
    loaded = load_llmc(tmp_path / "out.bin")
    assert np.array_equal(loaded.params["embed.weight"], model.params["embed.weight"])


def test_lora_adapters_are_refused_until_merged(tmp_path):
    model = gpt2()
    apply_lora(model, ["q_proj"], rank=2)
    with pytest.raises(ValueError, match="LoRA adapters.*merge_lora"):
        save_llmc(model, tmp_path / "out.bin")
    assert os.listdir(tmp_path) == []


def test_another_object_is_refused_with_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="got dict"):
        save_llmc({}, tmp_path / "out.bin")


def test_a_failed_write_leaves_no_file_and_an_old_file_as_it_was(tmp_path, monkeypatch):
    # oracle: the directory's listing and the old file's bytes
    path = tmp_path / "model.bin"
    path.write_bytes(b"old")
    calls = []

    def failing(f, array):
        calls.append(1)
        if len(calls) == 5:
            raise OSError("disk full")
        f.write(np.ascontiguousarray(array, dtype="<f4").tobytes())

    monkeypatch.setattr(llmc, "_write", failing)
    with pytest.raises(OSError, match="disk full"):
        save_llmc(gpt2(), path)
    assert os.listdir(tmp_path) == ["model.bin"] and path.read_bytes() == b"old"
    (tmp_path / "model.bin").unlink()
    calls.clear()
    with pytest.raises(OSError, match="disk full"):
        save_llmc(gpt2(), tmp_path / "new.bin")
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not HAS_VMHWM, reason="reads Linux's VmHWM")
def test_loading_holds_the_model_once(tmp_path):
    """Oracle: the process's peak resident memory grows by under 1.25 x 4N bytes + 8 MiB.

    A random Decoder overwritten by the file, a dict of converted copies, or
    the file's mapped pages kept resident beside the model would hold 2 x 4N.
    """
    cfg = DecoderConfig.gpt2(vocab_size=8192, emb_dim=256, num_layers=8, num_heads=4,
                             context_length=64, norm_eps=1e-5)
    path = tmp_path / "model.bin"
    save_llmc(Decoder(cfg, rng=0, dtype=np.float32), path)
    grown, params = load_growth("load_llmc", "load_llmc(sys.argv[1])", path)
    assert params > 8_000_000
    assert grown < 1.25 * 4 * params + 8 * 2 ** 20, f"{grown / 2**20:.0f} MiB for " \
        f"{4 * params / 2**20:.0f} MiB of weights"
