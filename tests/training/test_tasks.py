"""Tasks: determinism per seed, the kv-recall contract, independent streams, errors.

Oracles: two generators built from the same seed give equal batches; the
definition of the task (keys distinct within a sequence, the target is the
value stored at the queried key); the teacher's output recomputed by its layer.
"""
import numpy as np
import pytest

from qkvnp.training.tasks import KVRecallTask, TeacherTask, make_streams


def test_same_seed_same_batches_other_seed_other_batches():
    task = KVRecallTask(20, 10, 6)
    a = task.sample(make_streams(3).data, 8)
    b = task.sample(make_streams(3).data, 8)
    c = task.sample(make_streams(4).data, 8)
    for field in a._fields:
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert not np.array_equal(a.keys, c.keys)


def test_kv_recall_contract():
    task = KVRecallTask(num_keys=12, num_values=5, num_pairs=6)
    batch = task.sample(np.random.default_rng(0), 500)
    B, P = 500, 6
    assert batch.keys.shape == (B, P) and batch.values.shape == (B, P)
    assert batch.query.shape == (B,) and batch.target.shape == (B,)
    for field in batch:
        assert field.dtype == np.int64
    # keys of a sequence are distinct, so the answer is unique
    assert all(len(set(row)) == P for row in batch.keys.tolist())
    assert batch.keys.min() >= 0 and batch.keys.max() < 12
    assert batch.values.min() >= 0 and batch.values.max() < 5
    rows = np.arange(B)
    assert np.array_equal(batch.keys[rows, batch.position], batch.query)
    assert np.array_equal(batch.values[rows, batch.position], batch.target)
    # every position and every key gets asked (no hidden bias in the generator)
    assert set(batch.position.tolist()) == set(range(P))
    assert set(batch.query.tolist()) == set(range(12))


def test_heldout_stream_is_independent_of_the_training_stream():
    task = KVRecallTask(64, 64, 16)
    streams = make_streams(0)
    train = task.sample(streams.data, 256)
    heldout = task.sample(streams.heldout, 256)
    train_rows = {tuple(k) + tuple(v) for k, v in zip(train.keys.tolist(), train.values.tolist())}
    held_rows = {tuple(k) + tuple(v) for k, v in zip(heldout.keys.tolist(), heldout.values.tolist())}
    assert not train_rows & held_rows
    # and drawing training batches does not move the held-out set
    again = make_streams(0)
    task.sample(again.data, 1000)
    assert np.array_equal(task.sample(again.heldout, 256).keys, heldout.keys)


def test_teacher_task_is_deterministic_and_targets_are_the_teachers_output():
    task = TeacherTask(8, 2, 5, rng=make_streams(1).teacher)
    twin = TeacherTask(8, 2, 5, rng=make_streams(1).teacher)
    for name, value in task.teacher.params.items():
        assert np.array_equal(value, twin.teacher.params[name]), name
    assert np.abs(task.teacher.params["b_out"]).max() > 0  # biases are not left at zero
    batch = task.sample(np.random.default_rng(2), 3)
    assert batch.x.shape == (3, 5, 8) and batch.target.shape == (3, 5, 8)
    np.testing.assert_allclose(batch.target, task.teacher.forward(batch.x), rtol=1e-13)
    assert np.array_equal(batch.x, task.sample(np.random.default_rng(2), 3).x)


def test_float32_teacher():
    batch = TeacherTask(8, 2, 5, rng=0, dtype=np.float32).sample(np.random.default_rng(0), 2)
    assert batch.x.dtype == np.float32 and batch.target.dtype == np.float32


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_keys=4, num_values=4, num_pairs=5), ValueError, "num_pairs must be <= num_keys=4"),
    (dict(num_keys=0, num_values=4, num_pairs=1), ValueError, "num_keys must be >= 1"),
    (dict(num_keys=4.0, num_values=4, num_pairs=1), TypeError, "num_keys must be an int"),
])
def test_bad_task_settings(kwargs, error, match):
    with pytest.raises(error, match=match):
        KVRecallTask(**kwargs)


def test_bad_sample_arguments_and_seed():
    task = KVRecallTask(8, 8, 4)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        task.sample(np.random.default_rng(0), 0)
    with pytest.raises(TypeError, match="rng must be a numpy.random.Generator"):
        task.sample("seed", 4)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        make_streams(-1)
