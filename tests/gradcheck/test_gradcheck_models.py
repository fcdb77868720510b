"""The gradient checker on whole models: dropout, sampled entries, joint directions, progress.

Shape key: B batch, T tokens, E embedding, V vocabulary.

Oracles: central differences and complex step of the checker itself, on
layers whose backward the rest of the suite certifies; planted bugs (a
gradient doubled) that a sampled or joint check must catch; the GPT guide's
own "Checking it" block, run as written.
"""
import io
import re
from pathlib import Path

import numpy as np
import pytest

import qkvnp
from qkvnp.gradcheck import GradcheckReport, budget, check_layer
from qkvnp.layers import Model
from qkvnp.training.models import AttentionRegressor, KVRecallModel
from qkvnp.training.tasks import KVRecallTask

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "gpt_guide.md"


class KVRecallBatch(Model):
    """kv-recall on a fixed batch: its inputs are integer ids, so only parameters are checked.

    A :class:`qkvnp.Model` holding the model, so that the checker sees its
    dropout (``named_layers``) and its Generator (``generators``).
    """

    def __init__(self, model, seed=0):
        self.model = model
        self.batch = KVRecallTask(model.num_keys, model.num_values, 4).sample(
            np.random.default_rng(seed), 5)
        self.zero_grad()

    def forward(self, _unused):
        return self.model.forward(self.batch.keys, self.batch.values, self.batch.query)

    def backward(self, dlogits, retain_cache=False):
        self.model.backward(dlogits, retain_cache)
        return None


def tiny_gpt(dropout=0.0):
    return qkvnp.GPTModel(vocab_size=11, context_length=6, emb_dim=8, num_heads=2, num_layers=2,
                          dropout=dropout, rng=0)


def dropout_cases():
    """``(id, layer, inputs, forward_kwargs)`` for every kind of layer that has dropout."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 4, 8))
    return [
        ("MultiHeadAttention", qkvnp.MultiHeadAttention(8, 2, dropout=0.3, rng=0), (x,),
         {"is_causal": True}),
        ("SelfAttention", qkvnp.SelfAttention(8, 6, dropout=0.3, rng=0), (x,), {"is_causal": True}),
        ("Dropout", qkvnp.Dropout(0.3, rng=0), (x,), {}),
        ("TransformerBlock", qkvnp.TransformerBlock(8, 2, dropout=0.3, rng=0), (x,), {}),
        ("GPTModel", tiny_gpt(dropout=0.3), (rng.integers(0, 11, size=(2, 5)),), {}),
        ("KVRecallModel", KVRecallBatch(KVRecallModel(7, 5, 6, rng=1, dropout=0.3)),
         (np.zeros(1),), {}),
        ("AttentionRegressor", AttentionRegressor(8, 2, rng=0, dropout=0.3), (x,), {}),
    ]


CASES = dropout_cases()
IDS = [case[0] for case in CASES]


def kwargs_of(case):
    wrt = {"wrt_inputs": False} if case[0] == "KVRecallModel" else {}
    return {"forward_kwargs": case[3], **wrt}


# ------------------------------------------------------------------ dropout


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_training_mode_dropout_layer_is_refused(case):
    # oracle: the forward draws a new mask on each call, so no derivative exists
    _, layer, inputs, _ = case
    with pytest.raises(ValueError, match=r"model\.eval\(\).*replay_dropout=True"):
        check_layer(layer, *inputs, **kwargs_of(case))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_replayed_dropout_masks_pass_on_every_layer_with_dropout(case):
    # oracle: central differences of the forward with its masks held fixed
    _, layer, inputs, _ = case
    before = {name: g.bit_generator.state for name, g in layer.generators().items()}
    report = check_layer(layer, *inputs, replay_dropout=True, **kwargs_of(case))
    assert report.rows and report.ok, "\n" + report.table()
    # the check ran on a copy: the layer's Generators have not moved
    assert {name: g.bit_generator.state for name, g in layer.generators().items()} == before


def test_replayed_masks_are_applied_not_skipped():
    # oracle: the output gradient of Dropout is the kept mask over (1 - p):
    # zeros where dropped, 1/(1-p) * dout elsewhere; evaluation mode has no zeros
    x = np.random.default_rng(1).normal(size=(3, 50))
    report = check_layer(qkvnp.Dropout(0.5, rng=0), x, replay_dropout=True, sample=None)
    assert report.ok
    evaluation = check_layer(qkvnp.Dropout(0.5, rng=0).eval(), x)
    assert evaluation.ok and report.row("input 0").analytic != evaluation.row("input 0").analytic


def test_only_a_forward_that_draws_is_refused():
    # oracle: a Generator passed to forward advances on each call, so outputs
    # differ; a fixed mask or an int seed draws nothing from the layer
    layer = qkvnp.Dropout(0.3, rng=0)
    with pytest.raises(ValueError, match="replay_dropout"):
        check_layer(layer, np.ones((2, 6)), forward_kwargs={"rng": np.random.default_rng(0)})
    x = np.random.default_rng(0).normal(size=(2, 4, 8))
    attention = qkvnp.MultiHeadAttention(8, 2, dropout=0.3, rng=0)
    assert check_layer(attention, x, forward_kwargs={"rng": 1}).ok
    model = tiny_gpt(dropout=0.3)
    masks = {name: np.random.default_rng(1).random(shape) > 0.3
             for name, shape in model.dropout_mask_shapes((2,), 5).items()}
    idx = np.random.default_rng(2).integers(0, 11, size=(2, 5))
    assert check_layer(model, idx, forward_kwargs={"dropout_masks": masks}).ok


def test_replay_dropout_must_be_a_bool():
    with pytest.raises(TypeError, match="replay_dropout must be a bool, got str"):
        check_layer(qkvnp.Dropout(0.3), np.ones(3), replay_dropout="yes")


# ------------------------------------------------------------------ the guide


def guide_check_block():
    text = GUIDE.read_text(encoding="utf-8")
    section = text.split("## Checking it", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "the 'Checking it' section of docs/gpt_guide.md has no python block"
    return blocks[0]


def test_gpt_guide_check_section_passes(capsys):
    # oracle: the checker's own verdicts on the guide's model, run as the page has it
    namespace = {"np": np, "qkvnp": qkvnp}
    exec(compile(guide_check_block(), str(GUIDE), "exec"), namespace)
    reports = [value for value in namespace.values() if isinstance(value, GradcheckReport)]
    assert reports, "the block made no report"
    for report in reports:
        assert report.ok, "\n" + report.table()
    assert "OK" in capsys.readouterr().out


# ------------------------------------------------------------------ sampling


class DoubledScale(qkvnp.LayerNorm):
    """A planted bug: the norm's scale gradient doubled."""

    def _accumulate(self, name, grad):
        super()._accumulate(name, 2.0 * grad if name == "scale" else grad)


def planted_gpt():
    model = tiny_gpt()
    model.final_norm.__class__ = DoubledScale
    return model


def test_a_sampled_check_says_so_and_finds_a_planted_bug(rng):
    # oracle: a doubled gradient, found at any entry the sample picks
    idx = rng.integers(0, 11, size=(2, 5))
    report = check_layer(planted_gpt(), idx, sample=3)
    assert report.sampled.startswith("3 random entries of each tensor")
    assert "sampled: 3 random entries" in report.table()
    row = report.row("param final_norm.scale")
    assert not row.ok and row.diagnosis == "ratio"
    assert len(row.worst_index) == 1 and 0 <= row.worst_index[0] < 8  # an entry of the tensor
    assert report.row("param final_norm.shift").ok
    assert check_layer(tiny_gpt(), idx, sample=3).ok


def test_auto_sampling_starts_past_a_size(rng, monkeypatch):
    idx = rng.integers(0, 11, size=(2, 5))
    full = check_layer(tiny_gpt(), idx)  # 1,000-odd entries: all of them
    assert full.sampled == ""
    monkeypatch.setattr(budget, "SAMPLE_ABOVE", 100)
    monkeypatch.setattr(budget, "AUTO_SAMPLE", 5)
    sampled = check_layer(tiny_gpt(), idx)
    assert sampled.ok and sampled.sampled.startswith("5 random entries of each tensor")
    total = qkvnp.GPTModel.num_parameters(tiny_gpt())
    assert f"of {total:,} entries checked" in sampled.sampled


@pytest.mark.parametrize("sample, error", [(0, ValueError), (2.5, TypeError), ("all", TypeError)])
def test_sample_is_checked(sample, error):
    with pytest.raises(error, match=r'sample must be "auto", None or an int >= 1, got'):
        check_layer(qkvnp.Dropout(0.3).eval(), np.ones(3), sample=sample)


@pytest.mark.parametrize("method", ["central", "complex_step"])
def test_a_joint_check_passes_and_catches_a_planted_bug(method, rng):
    # the 124M check's logic on a small model: unit directions over every
    # parameter at once, two forwards each (one for complex step)
    idx = rng.integers(0, 11, size=(1, 4))
    report = check_layer(tiny_gpt(), idx, mode="joint", num_directions=3, method=method)
    assert report.ok, "\n" + report.table()
    assert [row.name for row in report.rows] == [f"all ({len(tiny_gpt().params)} tensors)"]
    assert report.sampled.startswith("3 random unit directions over all")
    bad = check_layer(planted_gpt(), idx, mode="joint", num_directions=3, method=method)
    assert not bad.ok


# ------------------------------------------------------------------ progress


def test_progress_goes_to_a_given_stream_with_an_estimate():
    stream = io.StringIO()
    report = check_layer(qkvnp.LayerNorm(4), np.random.default_rng(0).normal(size=(2, 4)),
                         progress=stream)
    lines = stream.getvalue().splitlines()
    # 16 entries (scale, shift, input), two forwards each
    assert re.fullmatch(r"gradcheck: 32 forwards of about \S+s each: about \d+s", lines[0])
    assert re.fullmatch(r"gradcheck: 32 forwards in \d+s", lines[-1])
    assert report.ok


def test_progress_shows_on_stderr_for_a_long_check_only(capsys, monkeypatch):
    check_layer(qkvnp.LayerNorm(4), np.random.default_rng(0).normal(size=(2, 4)))
    assert capsys.readouterr().err == ""  # a short check is quiet
    monkeypatch.setattr(budget, "PROGRESS_AFTER", 0.0)  # every check counts as long
    check_layer(qkvnp.LayerNorm(4), np.random.default_rng(0).normal(size=(2, 4)))
    err = capsys.readouterr().err
    assert "gradcheck: 32 forwards of about" in err and "gradcheck: 32 forwards in" in err
    check_layer(qkvnp.LayerNorm(4), np.random.default_rng(0).normal(size=(2, 4)), progress=False)
    assert capsys.readouterr().err == ""


def test_progress_must_be_a_bool_or_a_stream():
    with pytest.raises(TypeError, match="progress must be None, a bool or a stream"):
        check_layer(qkvnp.LayerNorm(4), np.ones((2, 4)), progress="stderr")
