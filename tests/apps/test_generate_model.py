"""``python -m qkvnp generate --model DIR``: a Hugging Face directory, its tokenizer, streamed text.

Oracles: the tokenizer trained here with Hugging Face's ``tokenizers``
(byte-level BPE; encode and decode are its own), :func:`qkvnp.generate` on the
model :func:`qkvnp.interop.from_hf` reads (the printed continuation is the
decode of its tokens), and transformers' greedy ``generate`` on the model it
saved (the same tokens). Skipped without transformers, torch or tokenizers.
"""
import sys

import numpy as np
import pytest

from model_dirs import END, model_dir
from qkvnp.apps.cli import main

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")
from qkvnp import interop  # noqa: E402

PROMPT = "The quick brown fox, où"


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def directory(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf, tokenizer = model_dir(path, request.param)
    return path, hf, tokenizer


def _generate(capsys, *argv):
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_prompt_round_trips_and_the_text_is_the_decode_of_generates_tokens(directory,
                                                                               capsys):
    # oracle: the tokenizer's own encode/decode, and qkvnp.generate on from_hf's model
    path, _, tokenizer = directory
    ids = tokenizer.encode(PROMPT).ids
    assert tokenizer.decode(ids) == PROMPT  # a byte-level BPE loses nothing
    ours = interop.Tokenizer(path)
    assert ours.encode(PROMPT) == ids and ours.decode(ids) == PROMPT
    assert ours.eos_id == tokenizer.token_to_id(END) and ours.vocab_size == 300
    code, out, err = _generate(capsys, "--model", str(path), "--prompt", PROMPT,
                               "--max-new-tokens", "12")
    assert code == 0, err
    model = interop.from_hf(str(path), dtype=np.float32)
    tokens = __import__("qkvnp").generate(model, np.array([ids]), 12, eos_id=ours.eos_id)
    assert out == tokenizer.decode(tokens[0].tolist()) + "\n"
    assert out.startswith(PROMPT)


def test_greedy_tokens_are_transformers_greedy_tokens(directory, capsys):
    # oracle: transformers' generate(do_sample=False) on the model it saved, float32 both
    torch = pytest.importorskip("torch")
    path, hf, tokenizer = directory
    ids = tokenizer.encode(PROMPT).ids
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    code, out, err = _generate(capsys, "--model", str(path), "--prompt", PROMPT,
                               "--max-new-tokens", "16")
    assert code == 0, err
    assert out == tokenizer.decode(theirs[0].tolist()) + "\n"


def test_top_p_and_seed_reproduce_and_the_seed_matters(directory, capsys):
    # oracle: the same command twice prints the same text; qkvnp.generate with the same
    # options gives the tokens printed
    path, _, tokenizer = directory
    argv = ["--model", str(path), "--prompt", PROMPT, "--max-new-tokens", "20",
            "--temperature", "1.5", "--top-p", "0.9", "--top-k", "50"]
    outs = [_generate(capsys, *argv, "--seed", str(seed))[1] for seed in (7, 7, 8)]
    assert outs[0] == outs[1]
    model = interop.from_hf(str(path), dtype=np.float32)
    ids = tokenizer.encode(PROMPT).ids
    tokens = __import__("qkvnp").generate(model, np.array([ids]), 20, temperature=1.5,
                                          top_p=0.9, top_k=50, rng=7, eos_id=0)
    assert outs[0] == tokenizer.decode(tokens[0].tolist()) + "\n"
    other = __import__("qkvnp").generate(model, np.array([ids]), 20, temperature=1.5,
                                         top_p=0.9, top_k=50, rng=8, eos_id=0)
    assert (outs[2] == outs[0]) == np.array_equal(other, tokens)


def test_text_streams_whole_characters(directory, capsys, monkeypatch):
    # oracle: each write is a piece of the final text, and no write ends inside a character
    path, _, _ = directory
    writes = []
    monkeypatch.setattr(sys.stdout, "write", lambda s: writes.append(s) or len(s))
    assert main(["generate", "--model", str(path), "--prompt", "é", "--max-new-tokens", "10",
                 "--temperature", "1", "--seed", "1"]) == 0
    text = "".join(writes)
    assert text.startswith("é") and len(writes) >= 3
    for piece in writes[:-1]:
        assert not piece.endswith("\ufffd")


@pytest.mark.parametrize("top_p", ["0", "1.5", "nan"])
def test_a_bad_top_p_is_refused_by_name(directory, capsys, top_p):
    path, _, _ = directory
    code, out, err = _generate(capsys, "--model", str(path), "--prompt", "x", "--top-p", top_p)
    assert code == 2 and "top_p must be a float in (0, 1]" in err and out == ""


def test_a_directory_without_tokenizer_needs_ids(tmp_path, capsys):
    # a model of 300 ids and no tokenizer.json: refused, naming the file and --ids; with
    # --ids the continuation's ids are printed, those of qkvnp.generate
    model_dir(tmp_path, "gpt2", tokenizer=False)
    code, out, err = _generate(capsys, "--model", str(tmp_path), "--prompt", "hi")
    assert code == 2 and "tokenizer.json" in err and "--ids" in err and out == ""
    code, out, err = _generate(capsys, "--model", str(tmp_path), "--ids", "5 6 7",
                               "--max-new-tokens", "6")
    assert code == 0, err
    model = interop.from_hf(str(tmp_path), dtype=np.float32)
    tokens = __import__("qkvnp").generate(model, np.array([[5, 6, 7]]), 6)
    assert out.split() == [str(t) for t in tokens[0]]


def test_without_the_tokenizers_package_the_extra_is_named(directory, capsys, monkeypatch):
    path, _, _ = directory
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers raises ImportError
    code, out, err = _generate(capsys, "--model", str(path), "--prompt", "x")
    assert code == 2 and "'tokenizers'" in err and "pip install 'qkvnp[hf]'" in err


def test_without_jinja2_chat_names_the_extra(directory, capsys, monkeypatch, tmp_path):
    import json
    import shutil

    chat = tmp_path / "chat"
    shutil.copytree(directory[0], chat)
    (chat / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 1 }}"}))
    monkeypatch.setitem(sys.modules, "jinja2", None)
    monkeypatch.setitem(sys.modules, "jinja2.sandbox", None)
    code, out, err = _generate(capsys, "--model", str(chat), "--prompt", "x", "--chat")
    assert code == 2 and "'jinja2'" in err and "pip install 'qkvnp[hf]'" in err and out == ""


def test_an_llmc_file_takes_ids_or_bytes_and_prints_ids(directory, tmp_path, capsys):
    # oracle: qkvnp.generate on load_llmc's model of the file save_llmc wrote; with
    # --tokenizer, the decode of its tokens
    from qkvnp.models.decoder import Decoder, DecoderConfig

    cfg = DecoderConfig.gpt2(vocab_size=300, emb_dim=16, num_layers=1, num_heads=2,
                             context_length=32)
    path = str(tmp_path / "model.bin")
    interop.save_llmc(Decoder(cfg, rng=0, dtype=np.float32), path)
    model = interop.load_llmc(path)
    for argv, prompt in ((["--ids", "3 1 4"], [3, 1, 4]), (["--prompt", "hé"], list("hé".encode()))):
        code, out, err = _generate(capsys, "--model", path, "--max-new-tokens", "5", *argv)
        assert code == 0, err
        tokens = __import__("qkvnp").generate(model, np.array([prompt]), 5)
        assert out.split() == [str(t) for t in tokens[0]]
    words, tokenizer = directory[0], directory[2]
    code, out, err = _generate(capsys, "--model", path, "--tokenizer", str(words), "--prompt",
                               PROMPT, "--max-new-tokens", "5")
    assert code == 0, err
    ids = tokenizer.encode(PROMPT).ids
    tokens = __import__("qkvnp").generate(model, np.array([ids]), 5, eos_id=0)
    assert out == tokenizer.decode(tokens[0].tolist()) + "\n"


def test_chat_renders_the_template_of_tokenizer_config(directory, capsys, tmp_path):
    # oracle: jinja2 renders the template as transformers would; the printed text starts
    # with the rendered prompt
    import json
    import shutil

    path, _, _ = directory
    chat = tmp_path / "chat"
    shutil.copytree(path, chat)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}" \
               "{% if add_generation_prompt %}<assistant>{% endif %}"
    (chat / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    code, out, err = _generate(capsys, "--model", str(chat), "--prompt", "hello", "--chat",
                               "--max-new-tokens", "3")
    assert code == 0, err
    assert out.startswith("<user>hello\n<assistant>")
    code, out, err = _generate(capsys, "--model", str(path), "--prompt", "hello", "--chat")
    assert code == 2 and "no chat template" in err
