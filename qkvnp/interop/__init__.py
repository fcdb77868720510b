"""Weights in and out of other libraries' layouts, never importing them.

One module a peer: :mod:`qkvnp.interop.pytorch` for PyTorch's modules and
the book's (:func:`from_torch`, :func:`to_torch`); :mod:`qkvnp.interop.hf`
for Hugging Face transformers' decoders (:func:`from_hf`, :func:`to_hf`), and their
directories (:func:`from_hf` of a path, :func:`save_hf`) through
``qkvnp.interop.safetensors``, qkvnp's own reader and writer of the format
(:class:`SafetensorsFile`, :func:`load_safetensors`, :func:`save_safetensors`);
:mod:`qkvnp.interop.llmc` for llm.c's GPT-2 files (:func:`load_llmc`,
:func:`save_llmc`); :mod:`qkvnp.interop.tokenizer` for a directory's
``tokenizer.json``, through Hugging Face's ``tokenizers`` (the ``hf`` extra, imported
when a tokenizer is loaded). Every name is re-exported here: ``from qkvnp.interop import from_torch``.
"""
from __future__ import annotations

from .hf import HF_ARCHITECTURES, from_hf, save_hf, to_hf
from .llmc import load_llmc, save_llmc
from .pytorch import LAYOUTS, from_torch, to_torch
from .safetensors import SafetensorsError, SafetensorsFile, load_safetensors, save_safetensors
from .tokenizer import ByteTokenizer, MissingExtraError, StreamDecoder, Tokenizer, load_tokenizer

__all__ = ["LAYOUTS", "from_torch", "to_torch", "HF_ARCHITECTURES", "from_hf", "to_hf",
           "save_hf", "SafetensorsError", "SafetensorsFile", "load_safetensors",
           "save_safetensors", "load_llmc", "save_llmc", "Tokenizer", "ByteTokenizer",
           "StreamDecoder", "MissingExtraError", "load_tokenizer"]
