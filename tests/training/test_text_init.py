"""``train --task text --init PATH``: fine-tune a model directory (or llm.c file), ``--save-hf``.

Oracles: the loss of the run itself going down (held-out, from the first
evaluation to the last); transformers' ``from_pretrained`` of the ``--save-hf``
directory, whose logits equal the trained qkvnp model's (both float32:
``rtol=1e-4, atol=1e-5``, the rounding of float32 matmuls summed in another
order); the untargeted weights of a LoRA run, equal bit for bit to the
init's; the uninterrupted run, which a resume equals bit for bit. Skipped
without transformers, torch or tokenizers.
"""
import io
import os

import numpy as np
import pytest

from model_dirs import TEXT, model_dir
from qkvnp.apps.cli import main
from qkvnp.training import text as text_task
from qkvnp.training.checkpoint import CheckpointError
from text_task_args import cli_args

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from qkvnp import interop  # noqa: E402

SETTINGS = dict(steps=12, context=16, batch_size=4, lr=3e-3, warmup=2, seed=1, eval_every=4,
                eval_windows=8, sample_every=6, sample_length=8)
TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # float32 against float32


@pytest.fixture(scope="module")
def init(tmp_path_factory):
    path = tmp_path_factory.mktemp("init")
    model_dir(path / "model", "llama")
    (path / "text.txt").write_text(TEXT * 3, encoding="utf-8")
    return str(path / "model"), str(path / "text.txt")


def _hf_logits(path, ids):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return hf(torch.tensor(ids)).logits.numpy()


@pytest.mark.parametrize("lora", [None, 2])
def test_the_loss_goes_down_and_save_hf_loads_in_transformers_with_equal_logits(init, tmp_path,
                                                                                lora):
    model_path, text = init
    out = str(tmp_path / "out")
    # NOTE: adapters on a random model's q and v alone move the loss less: a higher rate
    settings = dict(SETTINGS, lr=3e-3 if lora is None else 5e-2)
    config = text_task.TextConfig(text=text, init=model_path, lora_rank=lora, **settings)
    model, rows, code = text_task.train_text(config, save_hf=out, stream=io.StringIO())
    assert code == 0 and len(rows) == 3
    drop = 0.1 if lora is None else 0.01
    assert rows[-1][2] < rows[0][2] - drop, rows  # held-out loss, first evaluation to last
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    ids = np.random.default_rng(0).integers(0, 300, (2, 10))
    ours = model.eval().forward(ids)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(_hf_logits(out, ids), ours, **TOLERANCE)
    before = transformers.AutoModelForCausalLM.from_pretrained(model_path).state_dict()
    after = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    changed = sorted(name for name in before if not torch.equal(before[name], after[name]))
    if lora is None:
        assert len(changed) == len(before)
    else:  # only the adapted projections moved (merged adapters)
        assert changed == sorted(name for name in before
                                 if name.endswith(("q_proj.weight", "v_proj.weight"))), changed


@pytest.mark.parametrize("lora", [None, 2])
def test_a_resume_is_the_uninterrupted_run_bit_for_bit(init, tmp_path, capsys, lora):
    # oracle: the run that never stopped: its rows, and its parameters and optimizer state
    model_path, text = init
    config = text_task.TextConfig(text=text, init=model_path, lora_rank=lora, **SETTINGS)
    whole = str(tmp_path / "whole.npz")
    model, rows, _ = text_task.train_text(config, save=whole, stream=io.StringIO())
    part = str(tmp_path / "part.npz")
    text_task.train_text(config, save=part, stop_at=5, stream=io.StringIO())
    stream = io.StringIO()
    resumed, resumed_rows, code = text_task.train_text(config, resume=part, stream=stream)
    assert code == 0 and "resumed at step 5" in stream.getvalue()
    assert resumed_rows == rows
    assert sorted(resumed.params) == sorted(model.params)
    for name, value in model.params.items():
        np.testing.assert_array_equal(resumed.params[name], value, err_msg=name)
    # generate reads the fine-tune's checkpoint with its model's tokenizer
    assert main(["generate", "--resume", whole, "--prompt", "The quick", "--max-new-tokens",
                 "3"]) == 0
    assert capsys.readouterr().out.startswith("The quick")
    saved = text_task.read_text_checkpoint(whole)
    assert saved.config["init"] == model_path and len(saved.config["init_sha256"]) == 64
    assert any(name.endswith(".A") for name in saved.params) == (lora is not None)


def test_a_resume_against_changed_init_files_is_refused(init, tmp_path, capsys):
    model_path, text = init
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in os.listdir(model_path):
        (copy / name).write_bytes(open(os.path.join(model_path, name), "rb").read())
    config = text_task.TextConfig(text=text, init=str(copy), **SETTINGS)
    part = str(tmp_path / "part.npz")
    text_task.train_text(config, save=part, stop_at=2, stream=io.StringIO())
    with open(copy / "tokenizer.json", "a") as f:
        f.write("\n")  # still the same tokenizer, but not the same files
    with pytest.raises(CheckpointError, match="init_sha256"):
        text_task.train_text(config, resume=part, stream=io.StringIO())
    assert main(["train", "--task", "text", "--resume", part]) == 2
    err = capsys.readouterr().err
    assert "init_sha256" in err and "nothing was trained" in err


def test_the_command_line_fine_tunes_with_lora_and_writes_the_directory(init, tmp_path,
                                                                       capsys):
    model_path, text = init
    out = str(tmp_path / "tuned")
    assert main(["train", "--task", "text", "--init", model_path, "--text", text,
                 "--lora-rank", "2", "--lora-targets", "q_proj,o_proj", "--save-hf", out]
                + cli_args(dict(SETTINGS, steps=4))) == 0
    printed = capsys.readouterr().out
    assert "LoRA rank 2 on q_proj,o_proj" in printed and f"wrote {out}" in printed
    assert main(["generate", "--model", out, "--prompt", "The quick", "--max-new-tokens",
                 "4"]) == 0
    assert capsys.readouterr().out.startswith("The quick")


@pytest.mark.parametrize("argv, message", [
    (["--lora-rank", "2"], "--lora-rank and --lora-targets adapt a loaded model: give --init"),
    (["--init", "{model}", "--emb-dim", "8"], "--emb-dim is not an option of --init"),
    (["--init", "{model}", "--family", "gpt2"], "--family is not an option of --init"),
    (["--init", "{model}", "--lora-targets", "q_proj"], "give --lora-rank"),
    (["--init", "{model}", "--lora-rank", "2", "--lora-targets", "nope"], "nope"),
    (["--init", "{model}", "--context", "65"], "exceeds the context of --init"),
    (["--init", "{missing}"], "does not exist"),
    (["--save-hf", "{tmp}/out"], "--save-hf writes a Decoder: give --family or --init"),
])
def test_bad_options_are_refused_by_name_before_training(init, tmp_path, capsys, argv,
                                                         message):
    model_path, text = init
    argv = [a.format(model=model_path, missing=str(tmp_path / "missing"), tmp=tmp_path)
            for a in argv]
    assert main(["train", "--task", "text", "--text", text, "--steps", "2"] + argv) == 2
    out, err = capsys.readouterr()
    assert message in err and "step " not in out
    assert not os.path.exists(tmp_path / "out")


def test_without_the_tokenizers_package_the_extra_is_named(init, capsys, monkeypatch):
    import sys

    model_path, text = init
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers raises ImportError
    assert main(["train", "--task", "text", "--init", model_path, "--text", text]
                + cli_args(SETTINGS)) == 2
    out, err = capsys.readouterr()
    assert "pip install 'qkvnp[hf]'" in err and "nothing was trained" in err
    assert "step " not in out


def test_a_newcomers_first_commands_end_to_end(tmp_path, capsys):
    # a byte-level model trained here (vocabulary 256, no tokenizer.json), written with
    # --save-hf: transformers loads it with qkvnp's logits, generate writes text from it,
    # and --init fine-tunes it on bytes
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3, encoding="utf-8")
    first = str(tmp_path / "first")
    settings = dict(steps=6, context=16, emb_dim=16, num_heads=2, num_layers=1,
                    batch_size=4, eval_every=3, eval_windows=4, sample_every=6,
                    sample_length=8)
    assert main(["train", "--task", "text", "--family", "llama3", "--text", str(text),
                 "--save-hf", first] + cli_args(settings)) == 0
    capsys.readouterr()
    ids = np.frombuffer(b"The quick brown", np.uint8)[None].astype(np.int64)
    ours = interop.from_hf(first, dtype=np.float32).forward(ids)
    np.testing.assert_allclose(_hf_logits(first, ids), ours, **TOLERANCE)
    assert main(["generate", "--model", first, "--prompt", "The quick", "--max-new-tokens",
                 "5"]) == 0
    assert capsys.readouterr().out.startswith("The quick")
    assert main(["train", "--task", "text", "--init", first, "--text", str(text), "--save-hf",
                 str(tmp_path / "second")]
                + cli_args({k: v for k, v in settings.items()
                         if k not in ("emb_dim", "num_heads", "num_layers")})) == 0
    assert "ByteTokenizer()" in capsys.readouterr().out


def test_generate_from_a_fine_tune_whose_tokenizer_is_unreadable_is_one_error_line(
        init, tmp_path, capsys):
    # oracle: the command's contract: a file it cannot use is one error: line, status 2
    model_path, text = init
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in os.listdir(model_path):
        (copy / name).write_bytes(open(os.path.join(model_path, name), "rb").read())
    config = text_task.TextConfig(text=text, init=str(copy), **dict(SETTINGS, steps=2))
    saved = str(tmp_path / "tuned.npz")
    text_task.train_text(config, save=saved, stream=io.StringIO())
    (copy / "tokenizer.json").write_text("{not json")
    assert main(["generate", "--resume", saved, "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --resume:") and err.count("\n") == 1
