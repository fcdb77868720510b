"""``train --task text --family F``: a :class:`~qkvnp.Decoder` of a family's config on bytes.

Oracles: the family's preset (:class:`~qkvnp.DecoderConfig`) built by hand
with the sizes the module documents; the parameters of that Decoder built
with the run's seed; :func:`qkvnp.generate` on the loaded model (the
``generate`` command prints what it gives); the refusals name the option.
A family run's resume equals the uninterrupted run bit for bit:
``tests/training/test_text_checkpoints.py``, beside the GPT's.
"""
import dataclasses
import re

import numpy as np
import pytest

import qkvnp
from text_task_args import cli_args
from qkvnp.apps.cli import main
from qkvnp.models.decoder import DecoderConfig
from qkvnp.training import text as text_task
from qkvnp.training.text_family import FAMILIES, decoder_config

SMALL = dict(context=8, emb_dim=8, num_heads=2, num_layers=2, batch_size=3, eval_windows=4,
             sample_length=6, warmup=2, eval_every=2, sample_every=2, lr=0.01, seed=3)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_saves_and_generates(family, corpus, tmp_path, capsys):
    save = str(tmp_path / "run.npz")
    assert main(["train", "--task", "text", "--text", corpus, "--family", family, "--steps", "2",
                 "--save", save] + cli_args(SMALL)) == 0
    out = capsys.readouterr().out
    assert f"model: Decoder({family}: vocab 256, context 8, width 8, 2 heads of 4" in out
    assert out.count("sample at step") == 1
    model, checkpoint = text_task.load_text_checkpoint(save)
    assert isinstance(model, qkvnp.Decoder) and checkpoint.config["family"] == family
    assert main(["generate", "--resume", save, "--prompt", "the cat", "--max-new-tokens", "5",
                 "--temperature", "0"]) == 0
    idx = np.frombuffer(b"the cat", dtype=np.uint8).astype(np.int64)[None]
    expected = qkvnp.generate(model.eval(), idx, 5)[0, 7:].astype(np.uint8).tolist()
    assert capsys.readouterr().out == "the cat" + bytes(expected).decode("utf-8", "replace") + "\n"


def test_the_sizes_map_onto_the_presets_as_documented():
    config = text_task.TextConfig(context=16, emb_dim=24, num_heads=4, num_layers=3, kv_heads=2,
                                  family="qwen3_moe")
    expected = DecoderConfig.qwen3_moe(vocab_size=256, emb_dim=24, num_layers=3, num_heads=4,
                                       head_dim=6, num_kv_heads=2, context_length=16,
                                       moe_hidden_dim=32, num_experts=8, top_k=2)
    assert decoder_config(config) == expected  # F = 8 * 24 / 3 = 64, experts of 64 / 2
    gemma = decoder_config(text_task.TextConfig(context=16, emb_dim=24, num_heads=4,
                                                num_layers=1, family="gemma3"))
    assert (gemma.head_dim, gemma.hidden_dim, gemma.sliding_window) == (6, 64, 8)
    assert gemma.scale == 6 ** -0.5 and gemma.attn_softcap is None
    gpt2 = decoder_config(text_task.TextConfig(emb_dim=16, num_heads=2, family="gpt2"))
    assert gpt2.hidden_dim == 64 and gpt2.tie_embeddings and gpt2.positions == "learned"
    mistral = decoder_config(text_task.TextConfig(window=5, family="mistral"))
    assert mistral.layer_types == ("sliding_attention",) * 2 and mistral.sliding_window == 5
    config = text_task.TextConfig(family="llama3", seed=7, dtype="float64", **{
        k: v for k, v in SMALL.items() if k != "seed"})
    built = text_task._model(config)
    reference = qkvnp.Decoder(decoder_config(config), rng=7, dtype=np.float64)
    for name, value in reference.params.items():
        np.testing.assert_array_equal(built.params[name], value, err_msg=name)


def test_a_resume_refuses_another_family_naming_it(corpus, tmp_path, capsys):
    save = str(tmp_path / "run.npz")
    base = ["train", "--task", "text", "--text", corpus, "--steps", "2"] + cli_args(SMALL)
    assert main(base + ["--family", "llama3", "--save", save]) == 0
    capsys.readouterr()
    assert main(base + ["--family", "qwen3", "--steps", "3", "--resume", save]) == 2
    assert "trained with other --family" in capsys.readouterr().err


def test_a_checkpoint_written_before_families_is_a_gpt():
    # oracle: a GPT run's meta/config with its "family" key removed reads as that config
    values = {**dataclasses.asdict(text_task.TextConfig(emb_dim=16)), "task": "text",
              "corpus_sha256": "0" * 64}
    del values["family"]
    config, _ = text_task.text_config_of(values)
    assert config == text_task.TextConfig(emb_dim=16) and config.family is None


@pytest.mark.parametrize("options, message", [
    (["--family", "qwen3", "--dropout", "0.1"], "--dropout is not an option of --family qwen3"),
    (["--family", "llama3", "--rope"], "--rope is not an option of --family llama3: its "
                                       "positions are rotary already"),
    (["--family", "gpt2", "--rope"], "--rope is not an option of --family gpt2"),
    (["--family", "gpt2", "--kv-heads", "1"], "--kv-heads is not an option of --family gpt2"),
    (["--family", "qwen3_moe", "--window", "4"], "--window is not an option of --family "
                                                 "qwen3_moe"),
    (["--family", "gemma3", "--softcap", "5"], "--softcap is not an option of --family gemma3"),
    (["--family", "qwen3", "--emb-dim", "6", "--num-heads", "2"], "--family qwen3 uses RoPE.*must be even, got 3"),
])
def test_options_a_family_cannot_take_are_refused_by_name(corpus, capsys, options, message):
    code = main(["train", "--task", "text", "--text", corpus] + options)
    assert code == 2
    assert re.search(message, capsys.readouterr().err)


def test_an_unknown_family_is_argparse_s_usage_error(corpus, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--task", "text", "--text", corpus, "--family", "qwen2"])
    assert exit_info.value.code == 2
    assert "--family: invalid choice: 'qwen2'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--family must be one of gpt2, llama3"):
        text_task.TextConfig(family="qwen2").check()
