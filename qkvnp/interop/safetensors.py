"""The safetensors format, read and written by qkvnp itself (never the ``safetensors`` package).

Shape key: N a tensor's number of elements.

A file is: 8 bytes, the header's length ``n`` (little-endian unsigned); ``n``
bytes of JSON mapping each tensor's name to ``{"dtype", "shape",
"data_offsets": [begin, end]}`` (plus an optional ``"__metadata__"`` of
strings); then the tensors' bytes, little-endian, row-major, the offsets
counted from the end of the header. :class:`SafetensorsFile` checks the whole
header against the file's size before it maps anything, then memory-maps the
file: a tensor is read from the page cache when it is converted, never copied
before. :func:`save_safetensors` writes as the reference writer does (header
padded with spaces to a multiple of 8 bytes, tensors in order of their names),
atomically.

========  =====================  ========================================
code      numpy                  read as
========  =====================  ========================================
F64       float64                itself
F32       float32                itself
F16       float16                itself
BF16      (none)                 float32, exactly: its bits shifted left 16
I64..I8   int64..int8            itself
U8        uint8                  itself
BOOL      bool                   itself
========  =====================  ========================================
"""
from __future__ import annotations

import json
import math
import mmap
import os

import numpy as np

from .._io import atomic_write

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any, Mapping

__all__ = ["SAFETENSORS_DTYPES", "MAX_HEADER_BYTES", "SafetensorsError", "SafetensorsFile",
           "load_safetensors", "save_safetensors", "RepeatedKeyError", "unique_keys",
           "widen_bfloat16"]

#: The stored dtypes read and written, and their numpy dtype (BF16 is held as its bits, uint16).
SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8",
                      "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}
#: The longest header read (the reference reader's cap too): a larger length is refused.
MAX_HEADER_BYTES = 100 * 1024 * 1024
_CODES = {np.dtype(v): k for k, v in SAFETENSORS_DTYPES.items() if k != "BF16"}


def widen_bfloat16(bits: np.ndarray) -> np.ndarray:
    """The float32 values of bfloat16 ``bits`` (``uint16``), exactly: a new array.

    NOTE: every bfloat16 is a float32 whose low 16 bits are zero.

    >>> widen_bfloat16(np.array([0x3F80, 0xC000], np.uint16))
    array([ 1., -2.], dtype=float32)
    """
    wide = bits.astype(np.uint32)
    wide <<= 16  # in place: one array of the tensor's size, not two
    return wide.view(np.float32)


class SafetensorsError(ValueError):
    """A file that is not a valid safetensors file; the message names the file and the fault."""


class RepeatedKeyError(ValueError):
    """A JSON object names ``key`` twice (:func:`unique_keys`; the safetensors header, and
    ``config.json`` and the shards' index read by :mod:`qkvnp.interop.hf_directory`)."""

    def __init__(self, key):
        super().__init__(f"the name {key!r} is given twice")
        self.key = key


def unique_keys(pairs):
    """``json``'s ``object_pairs_hook``: the object's dict, refusing a key given twice
    (``json`` would keep the last) with a ``ValueError`` whose ``key`` names it."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise RepeatedKeyError(key)
        out[key] = value
    return out


def _read_header(f, path, size):
    """``(header dict, data start)``: the length and the JSON, checked against ``size``."""
    if size < 8:
        raise SafetensorsError(f"{path}: {size} bytes, too short for the 8-byte header length")
    n = int.from_bytes(f.read(8), "little")
    if n > MAX_HEADER_BYTES:
        raise SafetensorsError(f"{path}: header length {n} exceeds the cap of "
                               f"{MAX_HEADER_BYTES} bytes")
    if 8 + n > size:
        raise SafetensorsError(f"{path}: header length {n} runs past the end of the file "
                               f"({size} bytes)")
    try:
        header = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=unique_keys)
    except (UnicodeDecodeError, ValueError) as error:
        raise SafetensorsError(f"{path}: the header is not valid JSON: {error}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header is a JSON {type(header).__name__}, not an "
                               "object")
    return header, 8 + n


def _check_entry(path, name, entry):
    """``(numpy dtype, shape, begin, end)`` of one header entry, or an error naming it."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise SafetensorsError(f"{where} must have exactly dtype, shape and data_offsets, got "
                               f"{entry!r}"[:300])
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if code not in SAFETENSORS_DTYPES:
        raise SafetensorsError(f"{where} has the unknown dtype {code!r} (known: "
                               f"{sorted(SAFETENSORS_DTYPES)})")

    def is_count(value):
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not isinstance(shape, list) or not all(is_count(d) for d in shape):
        raise SafetensorsError(f"{where} has the shape {shape!r}: not a list of integers >= 0")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(is_count, offsets)) \
            or offsets[0] > offsets[1]:
        raise SafetensorsError(f"{where} has the data_offsets {offsets!r}: not [begin, end] "
                               "with 0 <= begin <= end")
    dtype = np.dtype(SAFETENSORS_DTYPES[code])
    expected = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
    if offsets[1] - offsets[0] != expected:
        raise SafetensorsError(f"{where}: data_offsets {offsets} hold {offsets[1] - offsets[0]} "
                               f"bytes, its shape {shape} x {code} needs {expected}")
    return dtype, tuple(shape), offsets[0], offsets[1]


def _check_layout(path, entries, data_bytes):
    """The tensors' byte ranges tile the data exactly: no gap, no overlap, nothing past the end."""
    position, previous = 0, None
    for name, (_, _, begin, end, _) in sorted(entries.items(), key=lambda item: item[1][2:4]):
        if begin < position:
            raise SafetensorsError(f"{path}: tensor {name!r} at bytes [{begin}, {end}) overlaps "
                                   f"tensor {previous!r}")
        if begin > position:
            raise SafetensorsError(f"{path}: the bytes [{position}, {begin}) before tensor "
                                   f"{name!r} belong to no tensor (the data must be contiguous)")
        if end > data_bytes:
            raise SafetensorsError(f"{path}: tensor {name!r} at bytes [{begin}, {end}) runs past "
                                   f"the end of the data ({data_bytes} bytes)")
        position, previous = end, name
    if position != data_bytes:
        raise SafetensorsError(f"{path}: the file holds {data_bytes - position} bytes after the "
                               "last tensor")


class SafetensorsFile:
    """One safetensors file, its header checked and its data memory-mapped.

    Parameters
    ----------
    path : str or os.PathLike

    Attributes
    ----------
    path : str
    metadata : dict of str -> str
        The header's ``__metadata__`` (empty when absent).
    names : list of str
        The tensors, in the order of their bytes.

    Raises
    ------
    SafetensorsError
        Before anything is mapped or allocated, naming the file and the
        fault: a header length past the file or above ``MAX_HEADER_BYTES`` (100 MiB),
        a header that is not JSON or names a tensor twice, an unknown dtype,
        a shape that is not integers >= 0, offsets whose size is not shape x
        dtype, that overlap, leave a gap or run past the file.
    FileNotFoundError
        No such file.

    Notes
    -----
    Use it as a context manager, or call :meth:`close`. The arrays of
    :meth:`raw` are views of the mapping, read-only.

    Examples
    --------
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> save_safetensors({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, path)
    >>> with SafetensorsFile(path) as f:
    ...     f.names, f.shape("w"), f.array("w")[1].tolist()
    (['w'], (2, 3), [3.0, 4.0, 5.0])
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._map: mmap.mmap | None = None
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            header, self._start = _read_header(f, self.path, size)
            metadata = header.pop("__metadata__", {})
            if not isinstance(metadata, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
                raise SafetensorsError(f"{self.path}: __metadata__ must map strings to strings")
            self.metadata = metadata
            self._entries = {name: (*_check_entry(self.path, name, entry), entry["dtype"])
                             for name, entry in header.items()}
            _check_layout(self.path, self._entries, size - self._start)
            if size > self._start:  # an empty mapping is an error: nothing to map then
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.names = sorted(self._entries, key=lambda name: self._entries[name][2])

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"SafetensorsFile({self.path!r}, {len(self.names)} tensors)"

    def _entry(self, name):
        if name not in self._entries:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        return self._entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor ``name``."""
        return self._entry(name)[1]

    def dtype_code(self, name: str) -> str:
        """The stored dtype of tensor ``name``: ``"F32"``, ``"BF16"``..."""
        return self._entry(name)[4]

    def raw(self, name: str) -> np.ndarray:
        """Tensor ``name`` as stored, a read-only view of the mapping (BF16 as its uint16 bits)."""
        dtype, shape, begin, end, _ = self._entry(name)
        if begin == end:
            return np.empty(shape, dtype)
        if self._map is None:
            raise ValueError(f"{self.path} is closed")
        count = (end - begin) // dtype.itemsize
        return np.frombuffer(self._map, dtype, count, self._start + begin).reshape(shape)

    def array(self, name: str) -> np.ndarray:
        """Tensor ``name`` for numpy: as stored (a view), BF16 widened to float32 (a copy)."""
        array = self.raw(name)
        return widen_bfloat16(array) if self._entry(name)[4] == "BF16" else array

    def release(self, name: str) -> None:
        """Let the kernel drop tensor ``name``'s pages from this process (read again if used)."""
        _, _, begin, end, _ = self._entry(name)
        if self._map is None or begin == end or not hasattr(self._map, "madvise"):
            return
        start = (self._start + begin) // mmap.PAGESIZE * mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, start, self._start + end - start)

    def close(self) -> None:
        """Unmap the file (left to the garbage collector while views of it are alive)."""
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view returned by raw() still reads it
                pass
            self._map = None


def load_safetensors(path: str | os.PathLike, *, dtype: Any = None) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, as new arrays.

    Parameters
    ----------
    path : str or os.PathLike
    dtype : numpy dtype, keyword-only, optional
        Cast every floating tensor to it; default: as stored (BF16 as float32).

    Returns
    -------
    dict of str -> ndarray
        In the order of the bytes.

    Raises
    ------
    SafetensorsError
        As :class:`SafetensorsFile`, before anything is read.
    """
    with SafetensorsFile(path) as f:
        out = {}
        for name in f.names:
            array = f.array(name)
            cast = dtype if dtype is not None and array.dtype.kind == "f" else array.dtype
            out[name] = np.array(array, dtype=cast)
            del array
            f.release(name)
    return out


def _bfloat16_bits(array):
    """float32 -> the nearest bfloat16's bits as uint16 (round half to even, as torch)."""
    bits = np.ascontiguousarray(array, np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
    out = (rounded >> 16).astype(np.uint16)
    out[np.isnan(array)] = 0x7FC0  # a NaN stays a NaN
    return out


def _code(name, array, dtype):
    """``(code, numpy dtype written)`` of one tensor: its own, or ``dtype`` for a float."""
    if dtype is not None and array.dtype.kind == "f":
        if isinstance(dtype, str) and dtype == "bfloat16":
            return "BF16", np.dtype("<u2")
        array_dtype = np.dtype(dtype)
    else:
        array_dtype = array.dtype
    code = _CODES.get(array_dtype.newbyteorder("<") if array_dtype.byteorder == ">"
                      else array_dtype)
    if code is None:
        raise TypeError(f"save_safetensors: tensor {name!r} would be stored as {array_dtype}, "
                        f"which safetensors lacks (codes: {sorted(SAFETENSORS_DTYPES)})")
    return code, array_dtype.newbyteorder("<")


def _bytes(array, code, stored):
    """The tensor's bytes as stored: contiguous, little-endian, BF16 rounded."""
    if code == "BF16":
        return _bfloat16_bits(array)
    return np.ascontiguousarray(array, stored)


def save_safetensors(tensors: Mapping[str, Any], path: str | os.PathLike, *,
                     dtype: Any = None, metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` as a safetensors file, atomically.

    Parameters
    ----------
    tensors : mapping of str -> array_like
        Written in order of their names.
    path : str or os.PathLike
        Replaced only once the new file is whole (``qkvnp._io.atomic_write``).
    dtype : numpy dtype or "bfloat16", keyword-only, optional
        Cast every floating tensor to it (``"bfloat16"``: rounded to nearest even).
    metadata : mapping of str -> str, keyword-only, optional
        The header's ``__metadata__`` (transformers writes ``{"format": "pt"}``).

    Raises
    ------
    TypeError
        A tensor whose dtype safetensors lacks, or a name or metadata entry
        that is not a string (before anything is written).
    """
    if not all(isinstance(name, str) for name in tensors) or "__metadata__" in tensors:
        raise TypeError("save_safetensors: tensor names must be strings other than "
                        "'__metadata__'")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str)
                                        for k, v in metadata.items()):
        raise TypeError("save_safetensors: metadata must map strings to strings")
    arrays = {name: np.asarray(tensors[name]) for name in sorted(tensors)}
    codes = {name: _code(name, array, dtype) for name, array in arrays.items()}
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, array in arrays.items():
        nbytes = array.size * codes[name][1].itemsize
        header[name] = {"dtype": codes[name][0], "shape": list(array.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the reference pads
    with atomic_write(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name, array in arrays.items():  # NOTE: one tensor converted at a time
            f.write(memoryview(_bytes(array, *codes[name]).reshape(-1).view(np.uint8)))
