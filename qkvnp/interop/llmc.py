"""llm.c's GPT-2 checkpoint files in and out of qkvnp's GPT-2 :class:`~qkvnp.models.decoder.Decoder`.

Shape key: maxT the context length, V the vocabulary, Vp the padded
vocabulary, L layers, NH heads, C channels (the embedding width).

The file (written by llm.c's ``train_gpt2.py``, read by ``train_gpt2.c``):
a header of 256 little-endian int32 (1024 bytes), then the 16 parameter
tensors back to back, each over all layers, with no padding between them:

=====  ==========  ==============  ==========================================
#      llm.c       shape           qkvnp's GPT-2 Decoder
=====  ==========  ==============  ==========================================
0      wte         (Vp, C)         ``embed.weight`` (rows V.. are padding)
1      wpe         (maxT, C)       ``pos_embed.weight``
2, 3   ln1w, ln1b  (L, C)          ``blocks.i.attn_norm.scale``, ``.shift``
4      qkvw        (L, 3C, C)      ``q_proj.W.T``, ``k_proj.W.T``, ``v_proj.W.T`` stacked
5      qkvb        (L, 3C)         ``q_proj.b``, ``k_proj.b``, ``v_proj.b`` joined
6, 7   attprojw/b  (L, C, C), C    ``o_proj.W.T``, ``o_proj.b``
8, 9   ln2w, ln2b  (L, C)          ``blocks.i.mlp_norm.scale``, ``.shift``
10,11  fcw, fcb    (L, 4C, C), 4C  ``mlp.layers.0.W.T``, ``.b``
12,13  fcprojw/b   (L, C, 4C), C   ``mlp.layers.2.W.T``, ``.b``
14,15  lnfw, lnfb  (C,)            ``final_norm.scale``, ``.shift``
=====  ==========  ==============  ==========================================

The header's ints: ``[0]`` the magic 20240326, ``[1]`` the version (3: the
tensors are float32; 5: bfloat16), ``[2:8]`` maxT, V, L, NH, C, Vp; the
rest zero. llm.c's matrices are ``nn.Linear`` weights, ``(out, in)``:
qkvnp's ``W`` is ``(in, out)``, hence the transposes. The head is tied to
the table, and llm.c's LayerNorm epsilon is 1e-5 (not in the file).
"""
from __future__ import annotations

import mmap
import os

import numpy as np

from .._io import atomic_write
from ..layers.lora import adapted_layers
from ..models.decoder import Decoder, DecoderConfig
from ..models.gpt import GPTModel
from .safetensors import widen_bfloat16

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any
    from .._typing import DTypeLike

__all__ = ["load_llmc", "save_llmc"]

# the first int of an llm.c GPT-2 checkpoint's header
_MAGIC = 20240326
_HEADER_INTS = 256
_HEADER_BYTES = 4 * _HEADER_INTS
_VERSIONS = {3: "float32", 5: "bfloat16"}  # version -> the tensors' stored dtype
_ITEMSIZE = {3: 4, 5: 2}
_PAD_MULTIPLE = 128  # train_gpt2.py pads V to a multiple of this at export
_NORM_EPS = 1e-5     # train_gpt2.c's layernorm_forward: a constant, not in the file


def _tensor_shapes(maxT, V, L, NH, C, Vp):
    """The 16 tensors' shapes, in the file's order (``V`` and ``NH`` fix no shape)."""
    del V, NH
    return [(Vp, C), (maxT, C), (L, C), (L, C), (L, 3 * C, C), (L, 3 * C), (L, C, C), (L, C),
            (L, C), (L, C), (L, 4 * C, C), (L, 4 * C), (L, C, 4 * C), (L, C), (C,), (C,)]


# ---------------------------------------------------------------- reading


def _read_header(path):
    """``(version, sizes)`` of the file at ``path``, every check passed.

    ``sizes`` is ``(maxT, V, L, NH, C, Vp)``. Reads 1024 bytes and stats the
    file: nothing in proportion to the sizes is allocated.
    """
    name = os.fspath(path)
    with open(name, "rb") as f:
        raw = f.read(_HEADER_BYTES)
        file_bytes = os.fstat(f.fileno()).st_size
    if len(raw) < _HEADER_BYTES:
        raise ValueError(f"llm.c file {name!r} is truncated: {file_bytes} bytes, shorter than "
                         f"its {_HEADER_BYTES}-byte header")
    header = np.frombuffer(raw, dtype="<i4")
    if header[0] != _MAGIC:
        raise ValueError(f"{name!r} is not an llm.c GPT-2 checkpoint: its magic number is "
                         f"{int(header[0])}, not {_MAGIC}")
    version = int(header[1])
    if version not in _VERSIONS:
        raise ValueError(f"llm.c file {name!r} has version {version}; qkvnp reads "
                         f"{', '.join(f'{v} ({d})' for v, d in _VERSIONS.items())}")
    sizes = tuple(int(value) for value in header[2:8])
    _check_sizes(name, sizes)
    expected = _HEADER_BYTES + _ITEMSIZE[version] * sum(
        int(np.prod(shape, dtype=object)) for shape in _tensor_shapes(*sizes))
    if file_bytes != expected:
        what = "is truncated" if file_bytes < expected else "has trailing bytes"
        raise ValueError(f"llm.c file {name!r} {what}: its header (maxT, V, L, NH, C, Vp = "
                         f"{sizes}, {_VERSIONS[version]}) describes {expected} bytes, the file "
                         f"has {file_bytes}")
    return version, sizes


def _check_sizes(name, sizes):
    """Refuse a header whose sizes no GPT-2 has, naming them."""
    labels = ("maxT", "V", "L", "NH", "C", "Vp")
    bad = [f"{label}={value}" for label, value in zip(labels, sizes) if value < 1]
    if bad:
        raise ValueError(f"llm.c file {name!r} has sizes that must be positive: {', '.join(bad)}")
    maxT, V, L, NH, C, Vp = sizes
    if C % NH:
        raise ValueError(f"llm.c file {name!r}: its channels C={C} are not a multiple of its "
                         f"heads NH={NH}")
    if Vp < V:
        raise ValueError(f"llm.c file {name!r}: its padded vocabulary Vp={Vp} is smaller than "
                         f"its vocabulary V={V}")


def _tensors(file, version, sizes):
    """The 16 tensors as read-only views of a memory map of ``file``, in the file's order,
    and the map (whose pages :func:`_release` lets go)."""
    stored = np.dtype("<f4") if version == 3 else np.dtype("<u2")
    mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    data = np.frombuffer(mapped, dtype=stored, offset=_HEADER_BYTES)
    out, start = [], 0
    for shape in _tensor_shapes(*sizes):
        count = int(np.prod(shape))
        out.append(data[start:start + count].reshape(shape))
        start += count
    return out, mapped


def _release(mapped):
    """Let the kernel drop the file's pages from this process (read again if touched).

    NOTE: a page of the map read once stays resident, counted in the process's
    memory, beside the model it was copied into: released after each tensor,
    the peak is the model and one tensor, not the model and the file.
    """
    if hasattr(mapped, "madvise"):
        mapped.madvise(mmap.MADV_DONTNEED)


def _widen(array, dtype):
    """A stored tensor in ``dtype``: float32 as is; bfloat16 bits widened exactly (``bits << 16``)."""
    if array.dtype == np.dtype("<u2"):
        array = widen_bfloat16(array)
    return np.asarray(array, dtype=dtype)


def _decoder_state(tensors, sizes, dtype):
    """The Decoder's ``(name, array)`` pairs from the 16 tensors, one at a time (``(out, in)``
    matrices transposed), so that at most one converted tensor is alive beside the model."""
    maxT, V, L, NH, C, Vp = sizes
    (wte, wpe, ln1w, ln1b, qkvw, qkvb, attprojw, attprojb, ln2w, ln2b,
     fcw, fcb, fcprojw, fcprojb, lnfw, lnfb) = tensors
    yield "embed.weight", _widen(wte[:V], dtype)  # (Vp, C) -> (V, C): padding dropped
    yield "pos_embed.weight", _widen(wpe, dtype)
    yield "final_norm.scale", _widen(lnfw, dtype)
    yield "final_norm.shift", _widen(lnfb, dtype)
    for i in range(L):
        block = f"blocks.{i}."
        qkv_weight, qkv_bias = _widen(qkvw[i], dtype), _widen(qkvb[i], dtype)  # (3C, C), (3C,)
        for j, role in enumerate("qkv"):
            yield block + f"self_attn.{role}_proj.W", qkv_weight[j * C:(j + 1) * C].T  # (C, C)
            yield block + f"self_attn.{role}_proj.b", qkv_bias[j * C:(j + 1) * C]
        yield block + "self_attn.o_proj.W", _widen(attprojw[i], dtype).T
        yield block + "self_attn.o_proj.b", _widen(attprojb[i], dtype)
        yield block + "attn_norm.scale", _widen(ln1w[i], dtype)
        yield block + "attn_norm.shift", _widen(ln1b[i], dtype)
        yield block + "mlp_norm.scale", _widen(ln2w[i], dtype)
        yield block + "mlp_norm.shift", _widen(ln2b[i], dtype)
        yield block + "mlp.layers.0.W", _widen(fcw[i], dtype).T  # (4C, C) -> (C, 4C)
        yield block + "mlp.layers.0.b", _widen(fcb[i], dtype)
        yield block + "mlp.layers.2.W", _widen(fcprojw[i], dtype).T  # (C, 4C) -> (4C, C)
        yield block + "mlp.layers.2.b", _widen(fcprojb[i], dtype)


def load_llmc(path: str | os.PathLike[str], *, dtype: DTypeLike = np.float32) -> Any:
    """A GPT-2 :class:`~qkvnp.models.decoder.Decoder` holding an llm.c checkpoint's weights.

    Parameters
    ----------
    path : str or os.PathLike
        A file written by llm.c (``train_gpt2.py``'s ``write_model``, or
        :func:`save_llmc`): version 3 (float32) or 5 (bfloat16).
    dtype : float dtype, keyword-only
        The Decoder's dtype. float32 by default: the file holds float32 (or
        bfloat16, widened exactly) values and llm.c computes in float32, so
        nothing is rounded and the model takes the memory of the file;
        ``np.float64`` for gradient checks.

    Returns
    -------
    Decoder
        ``DecoderConfig.gpt2`` with the file's sizes (``context_length`` its
        maxT), the head tied to the table, the padded vocabulary rows dropped.

    Raises
    ------
    ValueError
        Naming the file and what is wrong, before the tensors are read: a
        bad magic number, an unknown version, sizes no GPT-2 has (not
        positive, C not a multiple of NH, Vp < V), or a size other than
        the header describes: a truncated file, or trailing bytes (refused
        too: llm.c's writers put nothing after the tensors, so a surplus
        means the header is not the file's).
    OSError
        If the file cannot be opened.

    Notes
    -----
    The file is memory-mapped and converted one layer's tensor at a time.
    """
    version, sizes = _read_header(path)
    maxT, V, L, NH, C, Vp = sizes
    cfg = DecoderConfig.gpt2(vocab_size=V, emb_dim=C, num_layers=L, num_heads=NH,
                             context_length=maxT, norm_eps=_NORM_EPS)
    model = Decoder.empty(cfg, dtype=dtype)  # allocated, not filled: held once
    params, filled = model.params, set()
    with open(os.fspath(path), "rb") as file:
        tensors, mapped = _tensors(file, version, sizes)
        for name, value in _decoder_state(tensors, sizes, dtype):
            np.copyto(params[name], value, casting="unsafe")
            filled.add(name)
            _release(mapped)
        del tensors, value  # the views of the map, so that it can close
    if filled != set(params):  # every parameter has its tensor (the layout's own check)
        raise RuntimeError(f"load_llmc filled {sorted(filled)} of {sorted(params)}")
    return model


# ---------------------------------------------------------------- writing


def _refuse_lora(model):
    adapted = adapted_layers(model)
    if adapted:
        raise ValueError(f"save_llmc: the model has LoRA adapters at {adapted}, which llm.c's "
                         "file has no place for: merge them first (qkvnp.layers.merge_lora(model))")


def _decoder_sizes(model):
    """``(maxT, V, L, NH, C)`` of a GPT-2 Decoder, refusing anything llm.c's GPT-2 is not."""
    cfg = model.config
    if cfg.family != "gpt2":
        raise ValueError(f"save_llmc writes GPT-2; the Decoder's family is {cfg.family!r}")
    plain = DecoderConfig.gpt2(vocab_size=cfg.vocab_size, emb_dim=cfg.emb_dim,
                               num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                               context_length=cfg.context_length, norm_eps=_NORM_EPS)
    differs = [f"{name}={getattr(cfg, name)!r}" for name in plain.__dataclass_fields__
               if name != "init_std" and getattr(cfg, name) != getattr(plain, name)]
    if differs:
        raise ValueError(f"save_llmc: llm.c's GPT-2 has a tied head, a 4C-wide tanh-GELU MLP and "
                         f"LayerNorm eps 1e-5; the Decoder has {', '.join(differs)}")
    return cfg.context_length, cfg.vocab_size, cfg.num_layers, cfg.num_heads, cfg.emb_dim


def _gpt_sizes(model):
    """``(maxT, V, L, NH, C)`` of the book's GPTModel, refusing one llm.c cannot hold."""
    differs = [f"{name}={value!r}" for name, value, needed in (
        ("qkv_bias", model.qkv_bias, True), ("tie_embeddings", model.tie_embeddings, True),
        ("hidden_dim", model.hidden_dim, 4 * model.emb_dim),
        ("approximate", model.approximate, "tanh"),
        ("num_kv_heads", model.num_kv_heads, model.num_heads),
        ("variants", model.variants, None)) if value != needed]
    eps = sorted({norm.eps for name, norm in model.named_layers() if name.endswith(
        ("norm1", "norm2", "final_norm"))} - {_NORM_EPS})
    differs += [f"LayerNorm eps={value}" for value in eps]
    if differs:
        raise ValueError(f"save_llmc: llm.c's GPT-2 has qkv biases, a tied head, a 4C-wide "
                         f"tanh-GELU MLP and LayerNorm eps 1e-5; the GPTModel has "
                         f"{', '.join(differs)}")
    return (model.context_length, model.vocab_size, model.num_layers, model.num_heads,
            model.emb_dim)


def _names(model):
    """qkvnp's names of the table, positions, final norm and each block's parts."""
    if isinstance(model, GPTModel):
        block = {"ln1": "norm1", "ln2": "norm2", "q": "att.W_query", "k": "att.W_key",
                 "v": "att.W_value", "bq": "att.b_query", "bk": "att.b_key", "bv": "att.b_value",
                 "o": "att.W_out", "bo": "att.b_out", "fc": "ff.layers.0", "proj": "ff.layers.2"}
        return "tok_emb.weight", "pos_emb.weight", "trf_blocks.{}.", block
    block = {"ln1": "attn_norm", "ln2": "mlp_norm", "q": "self_attn.q_proj.W",
             "k": "self_attn.k_proj.W", "v": "self_attn.v_proj.W", "bq": "self_attn.q_proj.b",
             "bk": "self_attn.k_proj.b", "bv": "self_attn.v_proj.b", "o": "self_attn.o_proj.W",
             "bo": "self_attn.o_proj.b", "fc": "mlp.layers.0", "proj": "mlp.layers.2"}
    return "embed.weight", "pos_embed.weight", "blocks.{}.", block


def _layer_tensors(params, prefix, n):
    """One block's 12 tensors in llm.c's order and layout (``(out, in)`` matrices)."""
    p = {key: params[prefix + n[key]] for key in ("q", "k", "v", "bq", "bk", "bv", "o", "bo")}
    return [params[prefix + n["ln1"] + ".scale"], params[prefix + n["ln1"] + ".shift"],
            np.concatenate([p["q"].T, p["k"].T, p["v"].T]),           # (3C, C)
            np.concatenate([p["bq"], p["bk"], p["bv"]]),              # (3C,)
            p["o"].T, p["bo"],                                        # (C, C), (C,)
            params[prefix + n["ln2"] + ".scale"], params[prefix + n["ln2"] + ".shift"],
            params[prefix + n["fc"] + ".W"].T, params[prefix + n["fc"] + ".b"],      # (4C, C)
            params[prefix + n["proj"] + ".W"].T, params[prefix + n["proj"] + ".b"]]  # (C, 4C)


def _write(f, array):
    f.write(np.ascontiguousarray(array, dtype="<f4").tobytes())


def save_llmc(model: Any, path: str | os.PathLike[str]) -> None:
    """Write a GPT-2 as llm.c's checkpoint file: version 3, float32, V padded with zero rows.

    Parameters
    ----------
    model : Decoder or GPTModel
        A GPT-2 :class:`~qkvnp.models.decoder.Decoder` (``DecoderConfig.gpt2``,
        family ``"gpt2"``, its LayerNorm eps 1e-5 as llm.c's), or the book's
        :class:`~qkvnp.models.gpt.GPTModel` built with ``qkv_bias=True`` and
        ``tie_embeddings=True`` (and otherwise plain: no RoPE, window...).
    path : str or os.PathLike
        The file to write, atomically (a failed write leaves no file and an
        old one as it was).

    Raises
    ------
    ValueError
        Before anything is written, naming what llm.c's GPT-2 cannot hold:
        another family, another model class, an untied head, no qkv
        biases, another MLP width or GELU, LoRA adapters (merge them first).
    TypeError
        If ``model`` is neither a Decoder nor a GPTModel.

    Notes
    -----
    As llm.c's ``train_gpt2.py`` writes it: the table padded to ``Vp``, the
    next multiple of 128, with zero rows, ``Vp`` in the header's 8th int.
    A float64 model is rounded to float32, llm.c's only dtype in version 3.

    Examples
    --------
    >>> import os, tempfile
    >>> from qkvnp.models.decoder import Decoder, DecoderConfig
    >>> cfg = DecoderConfig.gpt2(vocab_size=50, emb_dim=8, num_layers=1, num_heads=2,
    ...                          context_length=16)
    >>> path = os.path.join(tempfile.mkdtemp(), "gpt2.bin")
    >>> save_llmc(Decoder(cfg, rng=0, dtype=np.float32), path)
    >>> load_llmc(path).params["embed.weight"].shape
    (50, 8)
    """
    if isinstance(model, Decoder):
        sizes = _decoder_sizes(model)
    elif isinstance(model, GPTModel):
        sizes = _gpt_sizes(model)
    else:
        raise TypeError(f"save_llmc writes a GPT-2 Decoder or GPTModel, got {type(model).__name__}")
    _refuse_lora(model)
    maxT, V, L, NH, C = sizes
    Vp = -(-V // _PAD_MULTIPLE) * _PAD_MULTIPLE
    header = np.zeros(_HEADER_INTS, dtype="<i4")
    header[:8] = (_MAGIC, 3, maxT, V, L, NH, C, Vp)
    table, positions, block, parts = _names(model)
    params = model.params
    layers = [_layer_tensors(params, block.format(i), parts) for i in range(L)]
    with atomic_write(path) as f:
        f.write(header.tobytes())
        _write(f, params[table])
        _write(f, np.zeros((Vp - V, C), dtype="<f4"))  # (Vp - V, C) the padding rows
        _write(f, params[positions])
        for k in range(12):  # each tensor over all layers, in llm.c's order
            for layer in layers:
                _write(f, layer[k])
        _write(f, params["final_norm.scale"])
        _write(f, params["final_norm.shift"])
