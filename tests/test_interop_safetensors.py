"""qkvnp's own safetensors reader and writer (``qkvnp.interop.safetensors``).

Oracles:

- the ``safetensors`` package (a test dependency; skipped when absent) reads
  every file qkvnp writes, and qkvnp reads every file it writes, equal bit
  for bit; bfloat16 against torch's own widening (``tensor.float()``) and
  rounding (``tensor.to(torch.bfloat16)``);
- the format's definition, for the bytes qkvnp writes (8-byte length, a
  header padded with spaces to a multiple of 8, tensors in order of names);
- hostile files crafted byte by byte here: each refused with a
  ``SafetensorsError`` naming the file and the fault, before anything large
  is allocated (``tracemalloc`` sees less than 1 MiB while the file claims
  gigabytes).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from loading_memory import traced_peak
from qkvnp.interop import SafetensorsError, SafetensorsFile, load_safetensors, save_safetensors
from qkvnp.interop.safetensors import MAX_HEADER_BYTES

TENSORS = {
    "f64": np.arange(6, dtype=np.float64).reshape(2, 3) / 7,
    "f32": np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4),
    "f16": np.array([0.5, -2.0, 65504.0], dtype=np.float16),
    "i64": np.arange(5, dtype=np.int64) - 2,
    "i8": np.array([-128, 0, 127], dtype=np.int8),
    "u8": np.array([0, 255], dtype=np.uint8),
    "bool": np.array([True, False, True]),
    "empty": np.zeros((0, 3), dtype=np.float32),
    "scalar": np.array(1.5, dtype=np.float32),
}


def test_round_trip_every_dtype(tmp_path):
    path = tmp_path / "all.safetensors"
    save_safetensors(TENSORS, path, metadata={"format": "pt"})
    loaded = load_safetensors(path)
    assert list(loaded) == sorted(TENSORS)  # written in order of names, read in order of bytes
    for name, array in TENSORS.items():
        assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape, name
        np.testing.assert_array_equal(loaded[name], array, err_msg=name)
    with SafetensorsFile(path) as f:
        assert f.metadata == {"format": "pt"}
        assert f.dtype_code("f16") == "F16" and f.shape("f32") == (3, 4)


def test_the_bytes_follow_the_format(tmp_path):
    path = tmp_path / "w.safetensors"
    save_safetensors({"b": np.ones(3, np.float32), "a": np.arange(2, dtype=np.int32)}, path)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0 and raw[8:8 + n].rstrip(b" ").endswith(b"}")  # padded with spaces
    header = json.loads(raw[8:8 + n])
    assert list(header) == ["a", "b"]
    assert header["a"] == {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}
    assert header["b"] == {"dtype": "F32", "shape": [3], "data_offsets": [8, 20]}
    assert raw[8 + n:] == np.arange(2, dtype="<i4").tobytes() + np.ones(3, "<f4").tobytes()


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "w.safetensors"
    save_safetensors({"a": np.ones(2)}, path)
    before = path.read_bytes()
    with pytest.raises(TypeError, match="complex128"):
        save_safetensors({"a": np.ones(2), "b": np.ones(2, complex)}, path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["w.safetensors"]


def test_the_safetensors_package_reads_ours_and_we_read_its(tmp_path):
    st_numpy = pytest.importorskip("safetensors.numpy")
    ours = tmp_path / "ours.safetensors"
    save_safetensors(TENSORS, ours)
    theirs = st_numpy.load_file(str(ours))
    for name, array in TENSORS.items():
        np.testing.assert_array_equal(theirs[name], array, err_msg=name)
    path = tmp_path / "theirs.safetensors"
    st_numpy.save_file(TENSORS, str(path), metadata={"k": "v"})
    with SafetensorsFile(path) as f:
        assert f.metadata == {"k": "v"}
        for name, array in TENSORS.items():
            assert f.array(name).dtype == array.dtype, name
            np.testing.assert_array_equal(f.array(name), array, err_msg=name)


def test_bfloat16_is_widened_exactly_and_rounded_as_torch(tmp_path, torch):
    st_torch = pytest.importorskip("safetensors.torch")
    values = torch.randn(1000) * torch.logspace(-30, 30, 1000)
    values[:4] = torch.tensor([0.0, -0.0, float("inf"), -float("inf")])
    stored = values.to(torch.bfloat16)
    path = tmp_path / "bf16.safetensors"
    st_torch.save_file({"x": stored}, str(path))
    with SafetensorsFile(path) as f:
        assert f.dtype_code("x") == "BF16" and f.array("x").dtype == np.float32
        assert np.array_equal(f.array("x").view(np.uint32), stored.float().numpy().view(np.uint32))
    ours = tmp_path / "ours.safetensors"
    save_safetensors({"x": values.numpy()}, ours, dtype="bfloat16")
    assert torch.equal(st_torch.load_file(str(ours))["x"], stored)


# ---------------------------------------------------------------- hostile files


def crafted(tmp_path, header, data=b"", length=None):
    """A file of a header (dict or raw bytes) and data, with the length given or true."""
    path = tmp_path / "bad.safetensors"
    if header is None:  # the data alone
        path.write_bytes(data)
        return path
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(text) if length is None else length
    path.write_bytes(n.to_bytes(8, "little") + text + data)
    return path


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


GIGA = 2 ** 30
HOSTILE = {  # case: (header, data, length or None, what the message says)
    "shorter than the length field": (None, b"\x08\x00\x00\x00", None, "too short"),
    "an empty header": (b"", b"", None, "not valid JSON"),
    "header length past the file": ({"a": entry()}, bytes(8), 10 ** 6, "past the end"),
    "huge header length": ({}, b"", 2 ** 62, "exceeds the cap"),
    "header just over the cap": ({}, b"", MAX_HEADER_BYTES + 1, "exceeds the cap"),
    "invalid JSON": (b"{not json", b"", None, "not valid JSON"),
    "not UTF-8": (b"\xff\xfe", b"", None, "not valid JSON"),
    "a JSON list": (b"[1, 2]", b"", None, "not an object"),
    "a name twice": (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                     b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', bytes(8),
                     None, "'a' is given twice"),
    "unknown dtype": ({"a": entry("F8_E4M3", (2,), (0, 2))}, bytes(2), None, "unknown dtype"),
    "negative shape": ({"a": entry(shape=(-2,), offsets=(0, 0))}, b"", None, "shape"),
    "float shape": ({"a": entry(shape=(2.0,))}, bytes(8), None, "shape"),
    "bool shape": ({"a": entry(shape=(True, 2), offsets=(0, 8))}, bytes(8), None, "shape"),
    "string offsets": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}},
                       bytes(8), None, "data_offsets"),
    "reversed offsets": ({"a": entry(offsets=(8, 0))}, bytes(8), None, "begin <= end"),
    "offsets past the file": ({"a": entry(shape=(GIGA // 4,), offsets=(0, GIGA))}, bytes(8),
                              None, "runs past the end"),
    "size not shape x dtype": ({"a": entry(shape=(3,), offsets=(0, 8))}, bytes(8), None,
                               "needs 12"),
    "overlapping": ({"a": entry(offsets=(0, 8)), "b": entry(offsets=(4, 12))}, bytes(12), None,
                    "overlaps"),
    "a gap": ({"a": entry(offsets=(0, 8)), "b": entry(offsets=(12, 20))}, bytes(20), None,
              "belong to no tensor"),
    "bytes after the last tensor": ({"a": entry()}, bytes(12), None, "after the last"),
    "an extra key": ({"a": dict(entry(), extra=1)}, bytes(8), None, "exactly dtype"),
    "metadata not strings": ({"__metadata__": {"k": 1}}, b"", None, "__metadata__"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_files_are_refused_naming_the_file(tmp_path, case):
    header, data, length, message = HOSTILE[case]
    path = crafted(tmp_path, header, data, length)
    with traced_peak() as peak, pytest.raises(SafetensorsError, match=message) as info:
        SafetensorsFile(path)
    assert str(path) in str(info.value)
    assert peak[0] < 2 ** 20, f"{peak[0]} bytes allocated before refusing"
    assert isinstance(info.value, ValueError)


def test_a_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        SafetensorsFile(tmp_path / "absent.safetensors")


def test_views_stay_valid_after_close_and_release_keeps_values(tmp_path):
    path = tmp_path / "w.safetensors"
    save_safetensors({"a": np.arange(5000, dtype=np.float32)}, path)
    f = SafetensorsFile(path)
    view = f.raw("a")
    f.release("a")  # the pages are dropped; reading maps them again
    f.close()
    np.testing.assert_array_equal(view, np.arange(5000, dtype=np.float32))
    assert not view.flags.writeable
