"""The partner task, the pair bound it rests on, and its place in train and ablation.

Oracles: the definition of the task (a fixed-point-free involution; q and
pi(q) stored in every sequence; the target is the value stored under pi(q));
the closed form of the pair bound for tied Q=K, ``logit_a + logit_b =
-(a - b)^T W W^T (a - b) / sqrt(E)``, checked against the model's own
attention weights; a hand-built separate model that beats the bound; numpy
statistics of hand-written accuracies for the ablation's summary.
"""
import json
import os
import sys
import types
from unittest import mock

import numpy as np
import pytest

from qkvnp.apps.cli import main
from qkvnp.training.ablation import partner_attention, run_ablation, summarize
from qkvnp.training.ablation_report import (format_attention, pair_example,
                                            plot_ablation, takeaway, to_json)
from qkvnp.training.loop import TrainConfig, build_task, train
from qkvnp.training.models import KVRecallModel
from qkvnp.training.report import attention_example, describe
from qkvnp.training.tasks import PartnerTask, draw_pairing, make_streams

TINY = dict(task="partner", num_keys=8, num_values=8, num_pairs=4, dim=8, eval_size=16)


# ---------------------------------------------------------------- the task


@pytest.mark.parametrize("num_keys", [2, 4, 10, 64])
def test_pairing_is_an_involution_without_fixed_points(num_keys):
    partner = draw_pairing(num_keys, np.random.default_rng(num_keys))
    keys = np.arange(num_keys)
    assert partner.shape == (num_keys,) and partner.dtype == np.int64
    assert np.array_equal(partner[partner], keys)  # pi(pi(k)) = k
    assert not np.any(partner == keys)  # nobody is its own partner
    assert np.array_equal(np.sort(partner), keys)  # a permutation


def test_pairing_refuses_odd_vocabularies():
    with pytest.raises(ValueError, match="num_keys must be even"):
        draw_pairing(7, 0)
    with pytest.raises(ValueError, match="num_keys must be even"):
        PartnerTask(num_keys=9, num_pairs=4, rng=0)
    with pytest.raises(ValueError, match="num_pairs must be >= 2"):
        PartnerTask(num_keys=8, num_pairs=1, rng=0)


def test_every_sequence_stores_the_query_and_its_partner_and_asks_for_the_partners_value():
    task = PartnerTask(num_keys=12, num_values=5, num_pairs=6, rng=1)
    batch = task.sample(np.random.default_rng(0), 600)
    B, P = 600, 6
    rows = np.arange(B)
    assert batch.keys.shape == (B, P) and batch.values.shape == (B, P)
    for field in batch:
        assert field.shape[0] == B and field.dtype == np.int64
    assert all(len(set(row)) == P for row in batch.keys.tolist())  # distinct keys
    assert np.array_equal(batch.keys[rows, batch.own], batch.query)
    assert np.array_equal(batch.keys[rows, batch.position], task.partner[batch.query])
    assert np.array_equal(batch.values[rows, batch.position], batch.target)
    assert not np.any(batch.own == batch.position)
    # no hidden bias: every key is asked, both entries take every position
    assert set(batch.query.tolist()) == set(range(12))
    assert set(batch.own.tolist()) == set(range(P)) == set(batch.position.tolist())


def test_the_pairing_is_fixed_by_the_seed_and_shared_by_training_and_heldout():
    config = TrainConfig(**TINY).resolved()
    one = build_task(config, make_streams(0).teacher)
    again = build_task(config, make_streams(0).teacher)
    other = [build_task(config, make_streams(seed).teacher).partner for seed in range(1, 6)]
    assert np.array_equal(one.partner, again.partner)
    assert any(not np.array_equal(one.partner, p) for p in other)
    result = train(TrainConfig(**TINY, steps=2))
    assert np.array_equal(result.task.partner, one.partner)


# ---------------------------------------------------------------- the pair bound


def _two_item_logits(model, a, b):
    """Log-odds "partner over own" of the queries a and b over the stored items [a, b]."""
    keys = np.array([[a, b], [a, b]])  # (2, P=2)
    values = np.zeros((2, 2), dtype=np.int64)
    _, weights = model.forward(keys, values, np.array([a, b]), return_weights=True)  # (2, 2)
    return np.log(weights[0, 1] / weights[0, 0]), np.log(weights[1, 0] / weights[1, 1])


@pytest.mark.parametrize("seed", range(5))
def test_tied_qk_margins_of_a_pair_add_up_to_minus_a_squared_norm(seed):
    # oracle: the closed form -(a-b)^T W W^T (a-b) / sqrt(E) of docs/derivations.md section 13
    model = KVRecallModel(6, 3, 4, variant="tied_qk", rng=seed)
    model.params["embed_value.weight"][...] = 0.0  # values carry nothing: the bound is exact
    a, b = 1, 4
    logit_a, logit_b = _two_item_logits(model, a, b)
    embed = model.params["embed_key.weight"]
    difference = (embed[a] - embed[b]) @ model.params["attention.W_qk"]  # (E,)
    expected = -(difference @ difference) / np.sqrt(4)
    assert logit_a + logit_b == pytest.approx(expected, rel=1e-10, abs=1e-12)
    assert logit_a + logit_b <= 0.0  # at most one of the pair prefers its partner


def test_separate_projections_can_send_both_queries_to_their_partners():
    # oracle: W_key = -W_query gives the bilinear form -W W^T, whose pair sum is +|(a-b) W|^2
    model = KVRecallModel(6, 3, 4, variant="separate", rng=0)
    model.params["embed_value.weight"][...] = 0.0
    model.params["attention.W_key"][...] = -model.params["attention.W_query"]
    model.params["query_marker"][...] = 0.0
    logit_a, logit_b = _two_item_logits(model, 1, 4)
    assert logit_a > 0 and logit_b > 0


def test_partner_attention_counts_queries_whose_own_entry_outweighs_the_partner():
    # oracle: a model whose attention is forced by hand, counted by hand
    task = PartnerTask(num_keys=8, num_values=4, num_pairs=3, rng=0)
    batch = task.sample(np.random.default_rng(0), 10)

    class Fixed:
        def forward(self, keys, values, query, return_weights=False):
            weights = np.full(keys.shape, 0.1)
            rows = np.arange(len(query))
            weights[rows, batch.own] = np.where(rows < 3, 0.8, 0.05)
            weights[rows, batch.position] = 0.15
            return None, weights

    measured = partner_attention(Fixed(), batch)
    assert measured["prefers_own"] == pytest.approx(0.3)
    assert measured["weight_own"] == pytest.approx((3 * 0.8 + 7 * 0.05) / 10)
    assert measured["weight_partner"] == pytest.approx(0.15)
    assert measured["weight_gap"] == pytest.approx((3 * 0.65 + 7 * 0.1) / 10)


# ---------------------------------------------------------------- train and ablation


def test_train_partner_from_the_command_line_with_save_and_resume(tmp_path, capsys):
    path = tmp_path / "run.npz"
    tiny = ["--num-keys", "8", "--num-values", "8", "--num-pairs", "4", "--dim", "8",
            "--eval-size", "16", "--quiet"]
    assert main(["train", "--task", "partner", "--steps", "4", "--save", str(path), *tiny]) == 0
    out = capsys.readouterr().out
    assert out.startswith("partner: 4 key/value pairs") and "partner" in out.splitlines()[0]
    assert main(["train", "--steps", "6", "--resume", str(path), "--quiet"]) == 0
    assert "done at step 6/6" in capsys.readouterr().out


def test_attention_example_marks_the_own_and_the_partner_entry():
    result = train(TrainConfig(**TINY, steps=2))
    weights, xlabels, ylabels, title = attention_example(result)
    assert weights.shape == (1, 4) and ylabels == ["query"]
    assert sum(label.endswith("(own)") for label in xlabels) == 1
    assert sum(label.endswith("(partner)") for label in xlabels) == 1
    assert title.startswith("query key") and "partner" in title
    assert describe(result.config, result.model).startswith("partner:")


def test_pair_example_asks_a_and_its_partner_over_the_same_items():
    models = {"tied": KVRecallModel(8, 8, 8, variant="tied_qk", rng=0)}
    weights, xlabels, ylabels = pair_example(models, 0, base=dict(TINY))
    assert weights["tied"].shape == (2, 4)
    np.testing.assert_allclose(weights["tied"].sum(axis=1), 1.0)
    assert sum(" (a)" in label for label in xlabels) == 1
    assert sum(" (b)" in label for label in xlabels) == 1
    a, b = (int(label.split("=")[1]) for label in ylabels)
    partner = build_task(TrainConfig(**TINY).resolved(), make_streams(0).teacher).partner
    assert partner[a] == b


def _entries(task, variant, accuracies, dim=16, own=None, weights=(None, None, None)):
    return [{"task": task, "dim": dim, "variant": variant, "seed": s, "accuracy": a,
             "parameters": 10, "prefers_own": own, "weight_own": weights[0],
             "weight_partner": weights[1], "weight_gap": weights[2]}
            for s, a in enumerate(accuracies)]


def test_takeaway_is_computed_from_the_numbers():
    rows = (_entries("partner", "separate", [1.0, 0.995, 0.998])
            + _entries("partner", "tied_qk", [0.41, 0.43, 0.52], own=0.55, weights=(0.45, 0.4, 0.05))
            + _entries("partner", "shared", [0.40, 0.39, 0.38], own=0.6)
            + _entries("partner", "no_value", [0.99, 0.98, 0.97]))
    text = takeaway(summarize(rows))
    assert "tied Q=K reaches at most 52.00% in any run" in text
    assert "(width 16; mean 45.33%)" in text
    assert "own entry above its partner's in 55.00% of" in text and "as the pair bound says" in text
    assert "separate W_query and W_key reach 99.77% at width 16 (min 99.50%)" in text
    assert ("each query splits its attention between the two entries (mean weight 0.45 on its "
            "own entry, 0.40 on its partner's, 0.05 apart per sequence)") in text
    decisive = takeaway(summarize(_entries("partner", "tied_qk", [0.5], own=0.5,
                                           weights=(0.5, 0.5, 0.9))))
    assert "each query puts its attention on one of the two entries" in decisive
    assert "stays at 40.00% at best" in text
    assert "costs up to 1.77 points" in text
    # the other numbers, the other words
    above = takeaway(summarize(_entries("partner", "tied_qk", [0.7]) + rows[:3]))
    assert "reaches up to 70.00%" in above and "above the pair bound" in above
    loophole = takeaway(summarize(_entries("partner", "tied_qk", [0.55], dim=64, own=0.45)
                                  + _entries("partner", "separate", [1.0], dim=64)))
    assert "a little under half prefer their own entry at width 64 (45.00%)" in loophole
    untrained = takeaway(summarize(_entries("partner", "tied_qk", [0.1])
                                   + _entries("partner", "separate", [0.2])))
    assert "too short or too narrow" in untrained
    kv = takeaway(summarize(_entries("kv-recall", "separate", [0.99])
                            + _entries("kv-recall", "tied_qk", [0.995])))
    assert "tied Q=K does as well as separate projections" in kv


def test_json_document_has_the_issues_schema():
    rows = (_entries("partner", "tied_qk", [0.5, 0.25], own=0.5, weights=(0.5, 0.25, 0.3))
            + _entries("kv-recall", "shared", [1.0]))
    document = to_json(summarize(rows), steps=7)
    assert sorted(document) == ["kv-recall", "partner"]
    (entry,) = document["partner"]
    assert {"variant", "width", "seeds", "accuracy_mean", "accuracy_min",
            "accuracy_max"} <= set(entry)
    assert (entry["variant"], entry["width"], entry["seeds"]) == ("tied_qk", 16, [0, 1])
    assert (entry["accuracy_mean"], entry["accuracy_min"], entry["accuracy_max"]) == (0.375, 0.25, 0.5)
    assert (entry["prefers_own"], entry["weight_own"], entry["weight_partner"],
            entry["weight_gap"]) == (0.5, 0.5, 0.25, 0.3)
    assert "prefers_own" not in document["kv-recall"][0]
    json.dumps(document)  # plain JSON types only


def test_attention_table_is_for_partner_only():
    lines = format_attention(summarize(_entries("partner", "tied_qk", [0.5, 0.25], own=0.625,
                                                weights=(0.5, 0.25, 0.375))))
    assert lines[0].split() == ["width", "variant", "prefers", "own", "on", "own", "on",
                                "partner", "|own", "-", "partner|"]
    assert lines[1].split() == ["16", "tied_qk", "62.50%", "0.50", "0.25", "0.38"]
    assert format_attention(summarize(_entries("kv-recall", "shared", [1.0]))) == []


def test_ablation_partner_command_writes_json_and_checks_before_training(tmp_path, capsys):
    out = tmp_path / "ablation.json"
    argv = ["ablation", "--task", "partner", "--quick", "--steps", "3", "--dims", "4",
            "--variants", "separate,tied_qk", "--num-keys", "8", "--num-values", "8",
            "--num-pairs", "4", "--eval-size", "16", "--json", str(out), "--quiet"]
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "partner ablation: 3 steps per run, seeds 0..1"  # --quick's 2 seeds
    assert "On partner, tied Q=K" in "\n".join(printed)
    document = json.loads(out.read_text())
    assert [(e["variant"], e["width"], e["seeds"]) for e in document["partner"]] == [
        ("separate", 4, [0, 1]), ("tied_qk", 4, [0, 1])]
    # an odd vocabulary is refused before the first run, and nothing is written
    assert main(["ablation", "--task", "all", "--num-keys", "7", "--num-pairs", "4",
                 "--json", str(tmp_path / "no.json")]) == 2
    assert "num_keys must be even" in capsys.readouterr().err
    assert not (tmp_path / "no.json").exists()


def test_plot_ablation_draws_one_panel_per_task_and_the_pair_heat_maps(tmp_path, monkeypatch):
    # matplotlib is optional: a stand-in records the panels and writes bytes
    drawn = {}

    class Figure(mock.MagicMock):
        def subplots(self, rows, columns, squeeze=True):
            drawn["panels"] = (rows, columns, squeeze)
            return [[mock.MagicMock() for _ in range(columns)] for _ in range(rows)]

        def savefig(self, file, format, dpi):
            file.write(b"\x89PNG stand-in")

    figure_module = types.ModuleType("matplotlib.figure")
    figure_module.Figure = Figure
    monkeypatch.setitem(sys.modules, "matplotlib", types.ModuleType("matplotlib"))
    monkeypatch.setitem(sys.modules, "matplotlib.figure", figure_module)
    rows = run_ablation(("separate", "tied_qk"), 1, (4,), 2, dict(TINY), task="partner",
                        keep_models=True)
    rows += run_ablation(("separate",), 1, (4,), 2, dict(TINY, task="kv-recall"))
    models = {row["variant"]: row["model"] for row in rows if row["task"] == "partner"}
    example = pair_example(models, 0, base=dict(TINY))
    path = tmp_path / "ablation.png"
    with open(os.devnull, "w") as devnull:
        assert plot_ablation(summarize(rows), path, example, stream=devnull)
    assert drawn["panels"] == (1, 4, False)  # kv-recall, partner, separate and tied heat maps
    assert path.read_bytes() == b"\x89PNG stand-in"


def test_demo_ends_with_the_pointer_to_the_ablation(capsys):
    # oracle: the issue asks the walkthrough to end with the question and where it is answered
    from qkvnp.apps.demo import walkthrough

    assert walkthrough() == 0
    out = capsys.readouterr().out
    tail = out[out.index("Why W_query, W_key and W_value"):]
    assert "python -m qkvnp ablation" in tail and "-(a - b)^T W W^T (a - b) <= 0" in tail
    assert tail.rstrip().endswith("All cross-checks agree.")


def test_ablation_plot_without_matplotlib_is_refused_before_any_run(monkeypatch, capsys, tmp_path):
    # oracle: the train command's refusal (tests/training/test_cli_checks.py), for ablation;
    # was: said so, ran every run and exited 0 with no plot
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    argv = ["ablation", "--task", "partner", "--seeds", "1", "--steps", "2", "--dims", "4",
            "--variants", "tied_qk", "--num-keys", "8", "--num-values", "8", "--num-pairs", "4",
            "--eval-size", "16", "--plot", str(tmp_path / "out.png")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no table: nothing ran
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "matplotlib is not installed" in lines[0]
    assert "pip install 'qkvnp[plot]'" in lines[0]
    assert not list(tmp_path.iterdir())

