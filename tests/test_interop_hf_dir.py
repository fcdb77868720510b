"""Hugging Face model directories: :func:`qkvnp.interop.from_hf` of a path, and :func:`save_hf`.

Oracles:

- transformers itself (skipped when absent), six families, small configs,
  random weights (no download): a directory written by ``save_pretrained``
  (float32; bfloat16; sharded with a small ``max_shard_size``) loaded by
  ``from_hf(dir, dtype=np.float32)`` gives transformers' float32 logits to
  ``ATOL_FLOAT32``; bfloat16 weights equal the bfloat16 model's weights
  widened to float32 bit for bit;
- ``save_hf`` then transformers' ``AutoModelForCausalLM.from_pretrained``
  gives qkvnp's logits to ``ATOL_FLOAT32``, its weights equal bit for bit
  (bfloat16: equal to torch's rounding of qkvnp's float32 weights);
- the files themselves: a tied table stored once, under transformers' name;
- hostile directories crafted here, each refused by name (the file and the
  fault) before the model is allocated (``tracemalloc``).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os

import numpy as np
import pytest

from qkvnp.interop import SafetensorsFile, from_hf, save_hf, save_safetensors, to_hf
from qkvnp.models.decoder import Decoder, DecoderConfig

from loading_memory import HAS_VMHWM, load_growth, traced_peak
from test_interop_hf import CLASSES, FAMILIES, V, hf_config

#: float32 logits of order 1, two implementations' sums in other orders (worst seen: 1.0e-6)
ATOL_FLOAT32 = 1e-5
KINDS = {"float32": {}, "bfloat16": {}, "sharded": {"max_shard_size": "20KB"}}


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def hf_model(torch, transformers, family, seed=0):
    """A small float32 transformers model, moved away from the init's near-uniform logits."""
    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[family])(hf_config(transformers, family)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def hf_logits(torch, model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


IDS = np.random.default_rng(0).integers(0, V, size=(2, 9))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_save_pretrained_directory_gives_transformers_logits(torch, transformers, tmp_path,
                                                              family, kind):
    reference = hf_model(torch, transformers, family)
    model = copy.deepcopy(reference)
    if kind == "bfloat16":
        model = model.to(torch.bfloat16)
        # NOTE: the weights widened, into a float32 model: a bfloat16 model's RoPE
        # frequencies (a buffer, not saved) would be rounded too
        reference.load_state_dict(model.float().state_dict())
    model.save_pretrained(tmp_path, **KINDS[kind])
    assert os.path.exists(tmp_path / "model.safetensors.index.json") == (kind == "sharded")
    ours = from_hf(tmp_path, dtype=np.float32)
    assert ours.dtype == np.float32 and ours.config.family == model.config.model_type
    theirs = {name: value.numpy() for name, value in reference.state_dict().items()}
    for name, value in to_hf(ours).items():
        np.testing.assert_array_equal(value, theirs[name], err_msg=name)
    logits = ours.forward(IDS)
    expected = hf_logits(torch, reference, IDS)
    assert logits.shape == expected.shape
    np.testing.assert_allclose(logits, expected, rtol=0, atol=ATOL_FLOAT32)


def test_the_default_dtype_is_float64_and_widens_exactly(torch, transformers, tmp_path):
    model = hf_model(torch, transformers, "llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    ours = from_hf(tmp_path)
    assert ours.dtype == np.float64
    expected = model.model.layers[0].mlp.up_proj.weight.detach().float().numpy().T
    np.testing.assert_array_equal(ours.params["blocks.0.mlp.up_proj.W"], expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_hf_loads_in_transformers_with_our_logits(torch, transformers, tmp_path, family):
    ours = from_hf(hf_model(torch, transformers, family, seed=1), dtype=np.float32)
    save_hf(ours, tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    assert type(theirs).__name__ == CLASSES[family] and theirs.dtype == torch.float32
    state = {name: value.numpy() for name, value in theirs.state_dict().items()}
    for name, value in to_hf(ours).items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    np.testing.assert_allclose(hf_logits(torch, theirs, IDS), ours.forward(IDS), rtol=0,
                               atol=ATOL_FLOAT32)
    again = from_hf(tmp_path, dtype=np.float32)  # and back: the same arrays
    for name, value in ours.params.items():
        np.testing.assert_array_equal(again.params[name], value, err_msg=name)


def test_save_hf_in_bfloat16_rounds_as_torch(torch, transformers, tmp_path):
    ours = from_hf(hf_model(torch, transformers, "qwen3"), dtype=np.float32)
    save_hf(ours, tmp_path, dtype="bfloat16")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert theirs.dtype == torch.bfloat16
    state = theirs.state_dict()
    for name, value in to_hf(ours).items():
        assert torch.equal(state[name], torch.from_numpy(value).to(torch.bfloat16)), name


@pytest.mark.parametrize("family, table, head", [
    ("gpt2", "transformer.wte.weight", False),       # tied: the table only, as transformers
    ("gemma3_text", "model.embed_tokens.weight", False),
    ("llama", "model.embed_tokens.weight", True),    # untied: lm_head.weight too
])
def test_a_tied_table_is_written_once(torch, transformers, tmp_path, family, table, head):
    model = hf_model(torch, transformers, family)
    model.save_pretrained(tmp_path / "theirs")
    save_hf(from_hf(model, dtype=np.float32), tmp_path / "ours")
    for where in ("theirs", "ours"):
        with SafetensorsFile(tmp_path / where / "model.safetensors") as f:
            assert table in f and ("lm_head.weight" in f) == head, where
    with SafetensorsFile(tmp_path / "theirs" / "model.safetensors") as theirs, \
            SafetensorsFile(tmp_path / "ours" / "model.safetensors") as ours:
        assert sorted(theirs.names) == sorted(ours.names)


def test_decoder_empty_is_unfilled_and_fills_as_loaded():
    cfg = DecoderConfig.qwen3(vocab_size=20, emb_dim=8, num_layers=2, num_heads=2, head_dim=4,
                              hidden_dim=12)
    made = Decoder(cfg, rng=0, dtype=np.float32)
    empty = Decoder.empty(cfg, dtype=np.float32)
    assert {n: (p.shape, p.dtype) for n, p in empty.params.items()} == \
        {n: (p.shape, p.dtype) for n, p in made.params.items()}
    assert all(not g.any() for g in empty.grads.values())
    empty.load_state_dict(made.state_dict())
    ids = np.array([[1, 2, 3]])
    np.testing.assert_array_equal(empty.forward(ids), made.forward(ids))


# ---------------------------------------------------------------- hostile directories


def tiny_directory(path, family="llama"):
    """A small model saved by save_hf (no transformers needed)."""
    if family == "gpt2":
        cfg = DecoderConfig.gpt2(vocab_size=V, emb_dim=16, num_layers=2, num_heads=2,
                                 context_length=32)
    else:
        cfg = DecoderConfig.llama3(vocab_size=V, emb_dim=16, num_layers=2, num_heads=2,
                                   hidden_dim=24, context_length=32)
    save_hf(Decoder(cfg, rng=0, dtype=np.float32), path)
    return path


def edit_config(path, **entries):
    config = json.loads((path / "config.json").read_text())
    for key, value in entries.items():
        if value is ...:
            del config[key]
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def shard(path):
    """The tiny model split in two shards with an index, as transformers writes them."""
    with SafetensorsFile(path / "model.safetensors") as f:
        arrays = {name: np.array(f.array(name)) for name in f.names}
    os.remove(path / "model.safetensors")
    names = sorted(arrays)
    halves = {"model-00001-of-00002.safetensors": names[:5],
              "model-00002-of-00002.safetensors": names[5:]}
    for file, part in halves.items():
        save_safetensors({name: arrays[name] for name in part}, path / file)
    weight_map = {name: file for file, part in halves.items() for name in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return weight_map


def refused(path, error, message):
    """``from_hf(path)`` raises ``error`` matching ``message``, allocating under 1 MiB."""
    with traced_peak() as peak, pytest.raises(error, match=message) as info:
        from_hf(path)
    assert peak[0] < 2 ** 20, f"{peak[0]} bytes allocated before refusing"
    return str(info.value)


def test_a_directory_without_config_or_weights_is_refused(tmp_path):
    refused(tmp_path / "absent", FileNotFoundError, "not a directory")
    refused(tmp_path, FileNotFoundError, "no config.json")
    tiny_directory(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    refused(tmp_path, FileNotFoundError, "no model.safetensors")


@pytest.mark.parametrize("key, value, message", [
    ("vocab_size", ..., "config.json has no 'vocab_size'"),            # missing
    ("num_hidden_layers", 10 ** 9, "num_hidden_layers=1000000000"),    # absurd
    ("hidden_size", -16, "hidden_size=-16"),                           # negative
    ("intermediate_size", 24.5, "intermediate_size=24.5"),             # not an integer
    ("num_attention_heads", True, "num_attention_heads=True"),         # a bool
])
def test_a_config_with_missing_or_absurd_sizes_is_refused_by_name(tmp_path, key, value, message):
    tiny_directory(tmp_path)
    edit_config(tmp_path, **{key: value})
    assert "config.json" in refused(tmp_path, ValueError, message)


def test_a_config_disagreeing_with_the_tensors_is_refused_before_allocating(tmp_path):
    tiny_directory(tmp_path)
    edit_config(tmp_path, vocab_size=2 ** 24, hidden_size=2 ** 14)  # 1 TiB of table
    refused(tmp_path, ValueError, r"'model.embed_tokens.weight' has shape \(97, 16\), the "
                                  r"config says \(16777216, 16384\)")
    edit_config(tmp_path, vocab_size=V, hidden_size=16, num_hidden_layers=3)
    refused(tmp_path, ValueError, "has no 'model.layers.2")


def test_invalid_config_json_is_refused_by_name(tmp_path):
    tiny_directory(tmp_path)
    (tmp_path / "config.json").write_text('{"vocab_size": 97, "vocab_size": 98}')
    refused(tmp_path, ValueError, "config.json names 'vocab_size' twice")
    (tmp_path / "config.json").write_text("{")
    refused(tmp_path, ValueError, "config.json is not valid JSON")


def test_a_missing_shard_is_refused_by_name(tmp_path):
    tiny_directory(tmp_path)
    shard(tmp_path)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    refused(tmp_path, FileNotFoundError, "the shard 'model-00002-of-00002.safetensors' is missing")


def test_an_index_naming_a_tensor_twice_is_refused(tmp_path):
    tiny_directory(tmp_path)
    weight_map = shard(tmp_path)
    name, file = next(iter(weight_map.items()))
    text = json.dumps({"weight_map": weight_map})[:-2] + f', "{name}": "{file}"}}}}'
    (tmp_path / "model.safetensors.index.json").write_text(text)
    refused(tmp_path, ValueError, f"the index names '{name}' twice")


def test_an_index_naming_a_tensor_its_shard_lacks_is_refused(tmp_path):
    tiny_directory(tmp_path)
    weight_map = shard(tmp_path)
    name = next(iter(weight_map))
    weight_map[name] = "model-00002-of-00002.safetensors"  # it is in the first
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(tmp_path, ValueError, f"tensor '{name}' is not in its shard")


def test_an_index_pointing_outside_the_directory_is_refused(tmp_path):
    tiny_directory(tmp_path / "m")
    weight_map = shard(tmp_path / "m")
    weight_map[next(iter(weight_map))] = "../model-00001-of-00002.safetensors"
    (tmp_path / "m" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map}))
    refused(tmp_path / "m", ValueError, "is not a file name in the directory")


def test_a_malformed_safetensors_file_is_refused_naming_it(tmp_path):
    tiny_directory(tmp_path)
    path = tmp_path / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[:8] = (len(raw) * 2).to_bytes(8, "little")
    path.write_bytes(bytes(raw))
    assert str(path) in refused(tmp_path, ValueError, "runs past the end of the file")


@pytest.mark.parametrize("change, message", [
    ("drop", "has no 'model.layers.1.mlp.up_proj.weight'"),
    ("extra", r"entries \['model.layers.1.mlp.extra'\] are unknown"),
    ("shape", "'model.layers.1.mlp.up_proj.weight' has shape"),
])
def test_tensors_missing_unknown_or_misshapen_are_refused(tmp_path, change, message):
    tiny_directory(tmp_path)
    with SafetensorsFile(tmp_path / "model.safetensors") as f:
        arrays = {name: np.array(f.array(name)) for name in f.names}
    name = "model.layers.1.mlp.up_proj.weight"
    if change == "drop":
        del arrays[name]
    elif change == "extra":
        arrays["model.layers.1.mlp.extra"] = np.ones(3, np.float32)
    else:
        arrays[name] = arrays[name][:, :-1]
    save_safetensors(arrays, tmp_path / "model.safetensors")
    assert str(tmp_path / "model.safetensors") in refused(tmp_path, ValueError, message)


def test_nan_in_a_checkpoint_is_refused(tmp_path):
    tiny_directory(tmp_path, "gpt2")
    with SafetensorsFile(tmp_path / "model.safetensors") as f:
        arrays = {name: np.array(f.array(name)) for name in f.names}
    arrays["transformer.h.0.ln_1.bias"][3] = np.nan
    save_safetensors(arrays, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="'transformer.h.0.ln_1.bias' holds NaN or inf"):
        from_hf(tmp_path)


def test_save_hf_refuses_before_writing(tmp_path):
    cfg = DecoderConfig.gpt2(vocab_size=V, emb_dim=16, num_layers=1, num_heads=2,
                             context_length=32)
    odd = Decoder(dataclasses.replace(cfg, norm="rms"), rng=0)  # no GPT2Config says that
    with pytest.raises(ValueError, match=r"DecoderConfig's \['norm'\] cannot be written"):
        save_hf(odd, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        save_hf(Decoder(cfg, rng=0), tmp_path / "file")
    tiny_directory(tmp_path / "sharded")
    shard(tmp_path / "sharded")
    with pytest.raises(ValueError, match="holds a sharded checkpoint"):
        save_hf(Decoder(cfg, rng=0), tmp_path / "sharded")


def test_save_hf_then_from_hf_without_transformers(tmp_path):
    cfg = DecoderConfig.gemma3(vocab_size=V, emb_dim=16, num_layers=2, num_heads=2,
                               num_kv_heads=1, head_dim=8, hidden_dim=24, sliding_window=4,
                               context_length=32)
    model = Decoder(cfg, rng=0)
    save_hf(model, tmp_path)
    back = from_hf(tmp_path)
    assert back.config == cfg and back.dtype == np.float64
    for name, value in model.params.items():
        np.testing.assert_array_equal(back.params[name], value, err_msg=name)


@pytest.mark.skipif(not HAS_VMHWM, reason="reads Linux's VmHWM")
def test_loading_holds_the_model_once(tmp_path):
    """Oracle: the process's peak resident memory grows by under 1.25 x 4N bytes + 8 MiB.

    A random Decoder overwritten by the checkpoint, or a second copy of the
    weights, would hold 2 x 4N.
    """
    cfg = DecoderConfig.gpt2(vocab_size=8192, emb_dim=256, num_layers=8, num_heads=4,
                             context_length=64)
    save_hf(Decoder(cfg, rng=0, dtype=np.float32), tmp_path)
    grown, params = load_growth("from_hf", "from_hf(sys.argv[1], dtype=np.float32)", tmp_path)
    assert params > 8_000_000
    assert grown < 1.25 * 4 * params + 8 * 2 ** 20, f"{grown / 2**20:.0f} MiB for " \
        f"{4 * params / 2**20:.0f} MiB of weights"
