"""Every script of examples/ runs as ``python examples/NAME.py`` and says what it shows.

Oracle: each example's own cross-check, printed and read back here (the
cached decoding equals one causal forward, a replayed dropout mask gives the
same output, grouped-query attention equals repeated key/value heads, the
planted bug fails with the softmax diagnosis and the fixed backward passes,
the book's printed first context vector, tied Q = K below separate on the
partner task, the tiny GPT's held-out loss below the bigram baseline's, the losses of a transformers
model trained in qkvnp equal PyTorch's steps, a model directory written by
transformers generates its greedy tokens). The
docs build runs the same scripts through sphinx-gallery. matplotlib is optional: an example draws its figure (on the Agg backend)
only when matplotlib imports.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

#: What each example must print (regular expressions, searched in stdout).
EXPECTED = {
    "plot_attention_heatmap.py": [r"\[0\.3061 0\.821 ?\]", r"row sums: \[1\. 1\. 1\. 1\. 1\. 1\.\]"],
    "plot_kv_cache.py": [r"one causal forward: \d\.\d+e-1[5-7]", r"prompt \+ steps equal too: True",
                         r"RuntimeError: MultiHeadAttention\.backward after a kv_cache"],
    "plot_grouped_query_attention.py": [r"largest difference: (0\.0|\d\.\d+e-1[5-7])\n",
                                        r"'W_key': \(24, 8\)", r"\): OK\n"],
    "plot_dropout_replay.py": [r"the replayed mask gives the same output: True",
                               r"fast vs reference: (0\.0|\d\.\d+e-1[4-7])\n",
                               r"tiled vs reference: (0\.0|\d\.\d+e-1[4-7])\n",
                               r"\): OK\n", r"drawn dropout off: True"],
    "plot_gradcheck_planted_bug.py": [r"\): FAILED\n", r"diagnosis: softmax_axis",
                                      r"central O\(h\^2\).*\): OK\n",
                                      r"complex_step .*\): OK\n"],
    "plot_gradcheck_sweep.py": [r"central: smallest worst-case relative error \d\.\de-(0[7-9]|1\d)",
                                r"complex_step: smallest worst-case relative error \d\.\de-1[2-6]"],
    "plot_load_torch_weights.py": [r"^\[\[0\.319 +0\.4858\]"],
    # checked below: qkvnp's loss goes down; with transformers, the logits and losses agree
    "plot_finetune_transformers_model.py": [r"^qkvnp's loss: \d\.\d+ at step 1, \d\.\d+ at step 30$"],
    # checked below: with transformers, its greedy tokens
    "plot_generate_from_a_directory.py": [r"'config\.json', .*'model\.safetensors'"],
    "plot_tied_vs_separate_qk.py": [r"separate: held-out accuracy", r"tied_qk: held-out accuracy"],
    # the script asserts that every diagonal of the bias is -slope * offset
    "plot_alibi_bias.py": [r"slopes: 0\.5 0\.25 0\.125 0\.0625 0\.03125",
                           r"head 0, query 5, keys 0\.\.5: \[-2\.5, -2\.0, -1\.5, -1\.0, -0\.5, 0\.0\]"],
    "plot_rope_relative_positions.py": [r"over \d+ positions at offset 3: \d\.\d+e-1[4-7] \(round-off\)",
                                        r"rope_backward\(rope_forward\(x\)\) == x"],
    "plot_sliding_window_decoder.py": [r"cache bytes after 10, 100, 1000, 2000 steps: (\d+) \1 \1 \1\n",
                                       r"token by token vs full forward: \d\.\d+e-1[4-7]\n",
                                       r"chunks of 37: largest difference \d\.\d+e-1[4-7]\n"],
    "plot_gpt_with_todays_attention.py": [r"num_kv_heads=2, rope=True, softcap=30\.0, window=\(7, 0\)",
                                          r"the continuation repeats the period: True",
                                          r"a cache holds [1-8] keys, first at position \d+",
                                          r"rolling caches vs one forward: (0\.0|\d\.\d+e-1[3-7])\n"],
    # checked below: the last held-out loss under the bigram baseline's, and under the first
    "plot_train_tiny_gpt.py": [r"^bigram baseline \(add-one smoothing\), held-out loss \d\.\d+",
                               r"^step +600 +train \d\.\d+ .* ratio \d\.\d+$",
                               r"the held-out loss went down: True",
                               r"the GPT ends below the bigram baseline: True",
                               r"^def "],
}


def test_every_example_is_listed_and_short():
    scripts = sorted(path.name for path in EXAMPLES.glob("*.py"))
    assert scripts == sorted(EXPECTED)
    for name in scripts:
        lines = (EXAMPLES / name).read_text(encoding="utf-8").splitlines()
        assert len(lines) <= 80, f"{name} has {len(lines)} lines"
        # sphinx-gallery needs a docstring with a title first
        assert lines[0] == '"""' and set(lines[2]) == {"="}, name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs_and_prints_its_check(name, tmp_path):
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    for pattern in EXPECTED[name]:
        assert re.search(pattern, result.stdout, flags=re.M), \
            f"{name}: no match for {pattern!r} in:\n{result.stdout}"
    if name == "plot_tied_vs_separate_qk.py":
        accuracy = dict(re.findall(r"(\w+): held-out accuracy ([\d.]+)%", result.stdout))
        # the pair bound: tied Q = K answers about half at best
        assert float(accuracy["tied_qk"]) < 60 < float(accuracy["separate"])
    if name == "plot_train_tiny_gpt.py":
        # the run's own report: every evaluation's held-out loss beside the baseline's
        rows = re.findall(r"held-out (\d\.\d+) .* bigram (\d\.\d+)  ratio", result.stdout)
        held = [float(row[0]) for row in rows]
        assert len(held) == 6 and held[-1] < held[0] and held[-1] < float(rows[-1][1])
    if name == "plot_finetune_transformers_model.py":
        first, last = map(float, re.search(r"loss: (\S+) at step 1, (\S+)", result.stdout).groups())
        assert last < first - 1
        compared = "largest difference from PyTorch" in result.stdout
        assert compared != ("not installed: qkvnp trains alone" in result.stdout)
        if compared:
            # float64 both sides; transformers' float32 spots (RoPE angles, RMSNorm,
            # softmax) bound the agreement near float32's rounding
            logits = float(re.search(r"from transformers: (\S+)", result.stdout)[1])
            early, every = map(float, re.search(r"from PyTorch: (\S+) \(steps 1-10\), (\S+)",
                                                result.stdout).groups())
            # the rounding grows as the steps feed it back: about 1e-7 over the first
            # ten steps, up to about 2e-3 by the thirtieth, of losses near 3 to 5
            assert logits < 1e-6 and early < 1e-6 and every < 1e-2
    if name == "plot_generate_from_a_directory.py":
        compared = "as transformers' greedy generate" in result.stdout
        assert compared != ("not installed: qkvnp writes the directory" in result.stdout)
        if compared:
            assert "as transformers' greedy generate: True" in result.stdout
    if name == "plot_load_torch_weights.py":
        torch_ran = "largest difference from PyTorch" in result.stdout
        assert torch_ran != ("PyTorch is not installed" in result.stdout)
        if torch_ran:
            difference = float(re.search(r"from PyTorch: (\S+)", result.stdout)[1])
            assert difference < 1e-12
    assert not list(tmp_path.iterdir()), "an example wrote files"
