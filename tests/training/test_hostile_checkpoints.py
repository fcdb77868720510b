"""Hostile checkpoints: each is a CheckpointError naming the file and the entry, one
``error:`` line from the CLI (exit 2, no traceback), found before any array is loaded.

Oracles: the error type and the entry named in its message; the CLI's stderr
being exactly one line that starts with ``error:``; files on disk unchanged;
for the zip bombs and the headers that do not match their data, the bytes read
from each entry (its ``.npy`` header, never its data) and the tracemalloc peak
(< 20 MiB) against the 1.6 GB the bomb declares. No test here times anything:
the bytes read are what a slow refusal would show, counted exactly.
"""
import json
import math
import os
import struct
import zipfile

import numpy as np
import pytest

from loading_memory import traced_peak
from qkvnp.apps.cli import main
from qkvnp.training.checkpoint import CheckpointError, load_checkpoint, write_npz_atomic
from qkvnp.training.loop import TrainConfig, checkpoint_layout, train

TINY = dict(num_keys=8, num_values=8, num_pairs=4, dim=8, batch_size=16, eval_size=32)
BOMB_ELEMENTS = 200_000_000  # float64: 1.6 GB declared


@pytest.fixture
def saved(tmp_path):
    """A real checkpoint of a tiny kv-recall run at step 10."""
    path = tmp_path / "run.npz"
    train(TrainConfig(**TINY, steps=10), save=path)
    return path


def _rewrite(path, change):
    with np.load(path, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    change(arrays)
    write_npz_atomic(path, arrays)


def refused(path, entry, capsys, match=None):
    """The library raises CheckpointError naming ``path`` and ``entry``; the CLI prints one
    ``error:`` line and exits 2; nothing on disk changes. Returns the message."""
    directory = path.parent
    before = {name: (directory / name).read_bytes() for name in os.listdir(directory)
              if (directory / name).is_file()}
    with pytest.raises(CheckpointError) as info:
        train(TrainConfig(**TINY, steps=40), resume=path)
    message = str(info.value)
    assert repr(os.fspath(path)) in message, message
    assert entry in message, message
    if match is not None:
        assert match in message, message
    assert main(["train", "--resume", str(path), "--steps", "40", "--quiet"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --resume: "), captured.err
    assert entry in lines[0] and "Traceback" not in captured.err
    assert captured.out == ""  # nothing described, nothing trained
    after = {name: (directory / name).read_bytes() for name in os.listdir(directory)
             if (directory / name).is_file()}
    assert after == before
    return message


# ---------------------------------------------------------------- the cases


def test_a_directory_given_to_resume(tmp_path, capsys):
    # was: IsADirectoryError traceback
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    refused(folder, "is a directory", capsys)


def test_a_fifo_given_to_resume_does_not_hang(tmp_path, capsys):
    # opening a FIFO for reading would block until a writer comes
    fifo = tmp_path / "pipe.npz"
    os.mkfifo(fifo)
    refused(fifo, "not a regular file", capsys)


def test_an_rng_state_of_minus_one(saved, capsys):
    # was: OverflowError traceback from bit_generator.state
    def minus_one(arrays):
        state = json.loads(str(arrays["meta/rng_state"]))
        state["state"]["state"] = -1
        arrays["meta/rng_state"] = np.array(json.dumps(state))
    _rewrite(saved, minus_one)
    refused(saved, "'meta/rng_state'", capsys, match="not a PCG64 generator state")


@pytest.mark.parametrize("change, match", [
    (lambda states: states.update(extra=states["dropout_rng"]), "unexpected ['extra']"),
    (lambda states: states.pop("dropout_rng") and states.update(other={}), "missing ['dropout_rng']"),
    (lambda states: states.update(dropout_rng={"bit_generator": "PCG64", "state": 3}),
     "not a generator state"),
])
def test_generator_states_that_do_not_fit_the_model(saved, capsys, change, match):
    # the dropout Generators' states (meta/generator_states) are checked like the others
    def rewrite(arrays):
        states = json.loads(str(arrays["meta/generator_states"]))
        change(states)
        arrays["meta/generator_states"] = np.array(json.dumps(states))
    _rewrite(saved, rewrite)
    refused(saved, "'meta/generator_states'", capsys, match=match)


def _set(key, value):
    def change(state):
        if key in ("state", "inc"):
            state["state"][key] = value
        else:
            state[key] = value
    return change


# NOTE: numpy's own setter takes each of these; numpy never writes one
STATES_NUMPY_NEVER_WRITES = [
    (_set("has_uint32", 2), "has_uint32 must be 0 or 1, got 2"),
    (_set("has_uint32", -1), "has_uint32 must be 0 or 1, got -1"),
    (_set("has_uint32", True), "has_uint32 must be 0 or 1, got True"),
    (_set("inc", 2), "state['inc'] must be odd"),
]


@pytest.mark.parametrize("change, match", STATES_NUMPY_NEVER_WRITES)
def test_a_data_generator_state_numpy_never_writes(saved, capsys, change, match):
    # was: accepted, and the run went on from a state no run can reach
    def rewrite(arrays):
        state = json.loads(str(arrays["meta/rng_state"]))
        change(state)
        arrays["meta/rng_state"] = np.array(json.dumps(state))
    _rewrite(saved, rewrite)
    refused(saved, "'meta/rng_state'", capsys, match=match)


@pytest.mark.parametrize("change, match", STATES_NUMPY_NEVER_WRITES)
def test_a_dropout_generator_state_numpy_never_writes(saved, capsys, change, match):
    def rewrite(arrays):
        states = json.loads(str(arrays["meta/generator_states"]))
        change(states["dropout_rng"])
        arrays["meta/generator_states"] = np.array(json.dumps(states))
    _rewrite(saved, rewrite)
    refused(saved, "'meta/generator_states'", capsys, match=match)


def test_an_optimizer_entry_of_inf(saved, capsys):
    def inf(arrays):
        arrays["optim/exp_avg_sq/readout.W"][2, 3] = np.inf
    _rewrite(saved, inf)
    refused(saved, "'optim/exp_avg_sq/readout.W'", capsys, match="inf at index (2, 3)")


def test_an_optimizer_step_of_minus_five(saved, capsys):
    def minus_five(arrays):
        arrays["optim/step"] = np.array(-5, dtype=np.int64)
    _rewrite(saved, minus_five)
    refused(saved, "'optim/step'", capsys, match="is -5, but the checkpoint is at step 10")


def test_a_nan_parameter(saved, capsys):
    # was: ValueError from evaluate(), which did not name the file
    def nan(arrays):
        arrays["param/attention.W_key"][1, 1] = np.nan
    _rewrite(saved, nan)
    refused(saved, "'param/attention.W_key'", capsys, match="nan at index (1, 1)")


def test_a_stored_config_of_dim_ten_million_is_refused_before_anything_is_built(saved, capsys):
    # was: 3.9 GB over 14 s, then _ArrayMemoryError
    def huge(arrays):
        config = json.loads(str(arrays["meta/config"]))
        arrays["meta/config"] = np.array(json.dumps({**config, "dim": 10**7}))
    _rewrite(saved, huge)
    with traced_peak() as peak:
        refused(saved, "meta/config", capsys, match="dim must be <= 4096, got 10000000")
    assert peak[0] < 20 * 2**20


@pytest.mark.parametrize("change, entry", [
    # within every per-field maximum, but the model would be 2**28 parameters
    (dict(num_keys=2**16, num_values=2**16, dim=2**11), "dim too large"),
    # a held-out batch of 10**6 sequences of 4096 keys
    (dict(eval_size=10**6, num_keys=4096), "one batch would need"),
    (dict(steps=1.5), "steps must be an int"),
    (dict(lr="fast"), "lr must be a finite number"),
])
def test_a_stored_config_beyond_the_bounds(saved, capsys, change, entry):
    def edit(arrays):
        config = json.loads(str(arrays["meta/config"]))
        arrays["meta/config"] = np.array(json.dumps({**config, **change}))
    _rewrite(saved, edit)
    refused(saved, "meta/config", capsys, match=entry)


def test_a_deeply_nested_config_is_invalid_json_not_a_recursion_error(saved, capsys):
    def nested(arrays):
        arrays["meta/config"] = np.array("[" * 30_000 + "]" * 30_000)
    _rewrite(saved, nested)
    refused(saved, "meta/config", capsys, match="not valid JSON")


def test_an_overlong_config_text_is_refused_from_its_header(saved, capsys):
    def long(arrays):
        arrays["meta/config"] = np.array(" " * 100_000 + "{}")
    _rewrite(saved, long)
    refused(saved, "meta/config", capsys, match="more than a checkpoint writes")


def test_a_checkpoint_beyond_its_own_configurations_steps(saved, capsys):
    def beyond(arrays):
        config = json.loads(str(arrays["meta/config"]))
        arrays["meta/config"] = np.array(json.dumps({**config, "steps": 5}))
    _rewrite(saved, beyond)
    refused(saved, "meta/step", capsys, match="beyond the 5 steps of its configuration")


def test_a_repeated_entry_name(saved, capsys):
    with zipfile.ZipFile(saved, "a") as archive, pytest.warns(UserWarning, match="Duplicate"):
        archive.writestr("param/readout.b.npy", b"")
    refused(saved, "'param/readout.b'", capsys, match="appears twice")


# ---------------------------------------------------------------- headers before data


def _npy_header(shape, dtype="<f8"):
    """A version 1.0 ``.npy`` header declaring ``shape`` (hand-written, as an attacker would)."""
    header = repr({"descr": dtype, "fortran_order": False, "shape": shape})
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1")


def _add_member(path, name, payload, compress=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "a", compression=compress) as archive:
        archive.writestr(name + ".npy", payload)


def _declare_size(path, member, size):
    """Patch the zip's local and central headers so that ``member`` claims ``size`` bytes
    uncompressed (what a deflated run of zeros legitimately looks like: a few KB on disk)."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        local = archive.getinfo(member).header_offset
    assert data[local:local + 4] == b"PK\x03\x04"
    struct.pack_into("<I", data, local + 22, size)
    central = data.find(b"PK\x01\x02" + bytes(0))
    while central != -1:
        name_length = struct.unpack_from("<H", data, central + 28)[0]
        if data[central + 46:central + 46 + name_length] == member.encode():
            struct.pack_into("<I", data, central + 24, size)
        central = data.find(b"PK\x01\x02", central + 4)
    path.write_bytes(bytes(data))


def _cheap_refusal(path, monkeypatch):
    """Refuse ``path``; returns (bytes read from each entry, tracemalloc peak, message).

    The bytes are counted where every read of an entry passes, zipfile's
    ``ZipExtFile.read`` and ``read1``, keyed by the entry's name.
    """
    bytes_read = {}

    def counting(method):
        def read(self, *args, **kwargs):
            data = method(self, *args, **kwargs)
            bytes_read[self.name] = bytes_read.get(self.name, 0) + len(data)
            return data
        return read

    with monkeypatch.context() as patch:
        patch.setattr(zipfile.ZipExtFile, "read", counting(zipfile.ZipExtFile.read))
        patch.setattr(zipfile.ZipExtFile, "read1", counting(zipfile.ZipExtFile.read1))
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(path, checkpoint_layout)
    with traced_peak() as peak, pytest.raises(CheckpointError):
        load_checkpoint(path, checkpoint_layout)
    return bytes_read, peak[0], str(info.value)


def _only_headers_read(bytes_read, entry, header):
    """``entry`` was read exactly as far as its ``header``: none of its data. Every
    other array was read no further than a .npy header (numpy pads them to 64-byte
    multiples; ours take 128); only the small ``meta/`` entries (the stored
    configuration and generator states, bounded in size) were read whole."""
    assert bytes_read, "the loader read no entry at all"
    assert bytes_read.get(entry) == len(header), (entry, bytes_read.get(entry), len(header))
    arrays = {name: n for name, n in bytes_read.items() if not name.startswith("meta/")}
    assert max(arrays.values()) <= 256, sorted(arrays.items(), key=lambda kv: -kv[1])[:3]
    assert sum(bytes_read.values()) < 64 * 2**10, bytes_read


@pytest.mark.parametrize("name", [
    "extra",  # the case: an entry nobody asked for
    "param/readout.b",  # under an expected name: its header disagrees with the configuration
])
def test_a_zip_bomb_is_refused_from_its_header_in_under_20_mib(saved, capsys, monkeypatch,
                                                               name):
    # oracle: the 20 MiB, and its header as the only bytes read of the entry;
    # before, the whole 1.6 GB entry was read first (3.8 s, 1.6 GB)
    if name.startswith("param/"):
        with np.load(saved, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files if key != name}
        write_npz_atomic(saved, arrays)
    header = _npy_header((BOMB_ELEMENTS,))
    _add_member(saved, name, header + bytes(4096), zipfile.ZIP_DEFLATED)
    _declare_size(saved, name + ".npy", len(header) + 8 * BOMB_ELEMENTS)
    assert saved.stat().st_size < 100_000
    with zipfile.ZipFile(saved) as archive:  # what a reader of the directory sees: 1.6 GB
        assert archive.getinfo(name + ".npy").file_size > 1.6e9
    bytes_read, peak, message = _cheap_refusal(saved, monkeypatch)
    _only_headers_read(bytes_read, name + ".npy", header)
    assert peak < 20 * 2**20, peak
    # an unknown entry is named as stored; a model's entry as the parameter it would fill
    entry = repr(name) if name == "extra" else "parameter 'readout.b'"
    assert entry in message
    refused(saved, entry, capsys)


@pytest.mark.parametrize("shape, stored", [
    ((10**12,), 800),  # the case: was _ArrayMemoryError "Unable to allocate 7.28 TiB"
    ((8, 9), 8 * 72 - 8),  # a few bytes short of what it declares
    ((), 16),  # more data than declared
])
def test_a_header_that_does_not_match_its_data(saved, capsys, monkeypatch, shape, stored):
    name = "param/readout.b"
    with np.load(saved, allow_pickle=False) as data:
        arrays = {key: data[key] for key in data.files if key != name}
    write_npz_atomic(saved, arrays)
    header = _npy_header(shape)
    _add_member(saved, name, header + bytes(stored))
    bytes_read, peak, message = _cheap_refusal(saved, monkeypatch)
    _only_headers_read(bytes_read, name + ".npy", header)
    assert peak < 20 * 2**20, peak
    declared = 8 * math.prod(shape)
    assert f"declares shape {shape} dtype float64 ({declared:,} bytes)" in message
    refused(saved, repr(name), capsys, match=f"holds {stored:,} bytes")


@pytest.mark.parametrize("payload, match", [
    (_npy_header((3,), "|O") + bytes(24), "pickled Python objects"),  # object dtype
    (b"\x93NUMPY\x03\x00" + bytes(60), "format version (3, 0)"),  # an unknown .npy version
    (b"not an npy file at all", "truncated or corrupt"),
    (_npy_header((3,))[:20], "truncated or corrupt"),  # header cut short
])
def test_unreadable_or_pickled_headers(saved, capsys, payload, match):
    name = "param/readout.b"
    with np.load(saved, allow_pickle=False) as data:
        arrays = {key: data[key] for key in data.files if key != name}
    write_npz_atomic(saved, arrays)
    _add_member(saved, name, payload)
    refused(saved, repr(name), capsys, match=match)


def test_a_member_that_is_not_an_npy(saved, capsys):
    with zipfile.ZipFile(saved, "a") as archive:
        archive.writestr("notes.txt", b"hello")
    refused(saved, "'notes.txt'", capsys)


def test_a_valid_checkpoint_still_loads_and_resumes(saved):
    # the checks refuse nothing real: header-first reading gives back what was written
    with np.load(saved, allow_pickle=False) as data:
        reference = {name: data[name] for name in data.files}
    checkpoint = load_checkpoint(saved, checkpoint_layout)
    for name, value in checkpoint.params.items():
        assert np.array_equal(value, reference["param/" + name]) and value.dtype == np.float64
    assert checkpoint.path == os.fspath(saved) and checkpoint.step == 10
    assert train(TrainConfig(**TINY, steps=12), resume=checkpoint).step == 12
