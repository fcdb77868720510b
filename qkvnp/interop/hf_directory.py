"""A Hugging Face model directory's files: ``config.json`` and the safetensors weights.

Shape key: V vocabulary, E embedding.

:func:`open_directory` reads and checks what :func:`qkvnp.interop.from_hf`
needs from a directory as ``save_pretrained`` writes it, before anything
large is allocated: ``config.json`` (its sizes present and sane), then
``model.safetensors``, or the shards that ``model.safetensors.index.json``
lists (each shard there, each tensor named once and found in its shard).
The tensors stay memory-mapped (:class:`~qkvnp.interop.safetensors.SafetensorsFile`).
"""
from __future__ import annotations

import json
import os

import numpy as np

from .safetensors import SafetensorsFile, RepeatedKeyError, unique_keys

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any

__all__ = ["CONFIG_SIZE_KEYS", "MAX_CONFIG_SIZE", "CheckpointTensors", "open_directory",
           "read_json"]

#: The sizes a ``config.json`` must give, by ``model_type``.
CONFIG_SIZE_KEYS = {
    "gpt2": ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions"),
    "llama": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size", "max_position_embeddings"),
}
for _family in ("mistral", "qwen3", "qwen3_moe", "gemma3_text"):
    CONFIG_SIZE_KEYS[_family] = CONFIG_SIZE_KEYS["llama"]
#: The largest size accepted in a ``config.json`` (a layer count, a width, a vocabulary, a context).
MAX_CONFIG_SIZE = 2 ** 24
_MAX_JSON_BYTES = 64 * 1024 * 1024


def read_json(path: str, what: str) -> Any:
    """The JSON object of file ``path``; a ``ValueError`` naming it when it is not one.

    A key given twice is refused (``json`` would keep the last one silently).
    """
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size > _MAX_JSON_BYTES:
            raise ValueError(f"{path}: {what} is larger than {_MAX_JSON_BYTES} bytes")
        text = f.read()
    try:
        value = json.loads(text.decode("utf-8"), object_pairs_hook=unique_keys)
    except RepeatedKeyError as error:
        raise ValueError(f"{path}: {what} names {error.key!r} twice") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: {what} is not valid JSON: {error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: {what} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: {what} must hold a JSON object, got {type(value).__name__}")
    return value


def _check_sizes(config, path):
    """Each size the family needs is an integer in ``[1, MAX_CONFIG_SIZE]``."""
    for key in CONFIG_SIZE_KEYS.get(config.get("model_type"), ()):
        value = config.get(key)
        if value is None:
            raise ValueError(f"{path}: config.json has no {key!r}")
        if isinstance(value, bool) or not isinstance(value, int) or \
                not 1 <= value <= MAX_CONFIG_SIZE:
            raise ValueError(f"{path}: config.json's {key}={value!r} is not a size (an integer "
                             f"in [1, {MAX_CONFIG_SIZE}])")


class CheckpointTensors:
    """The tensors of one file or of shards, by name, as :func:`qkvnp.interop.from_hf` reads them.

    Parameters
    ----------
    files : dict of str -> SafetensorsFile
        Each tensor's file.
    where : str
        How messages name the checkpoint (its file or index).
    """

    def __init__(self, files: dict[str, SafetensorsFile], where: str) -> None:
        self.files, self.where = files, where
        self.files_layout = True  # Qwen3-MoE's experts one by one, as save_pretrained writes

    def __enter__(self) -> CheckpointTensors:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def names(self) -> set[str]:
        """The tensors' names."""
        return set(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s stored shape."""
        return self.files[name].shape(name)

    def array(self, name: str) -> np.ndarray:
        """Tensor ``name``, memory-mapped (BF16 widened to float32)."""
        return self.files[name].array(name)

    def release(self, name: str) -> None:
        """Drop tensor ``name``'s pages from this process."""
        self.files[name].release(name)

    def close(self) -> None:
        """Unmap every file."""
        for f in set(self.files.values()):
            f.close()


def _open_shards(directory, index_path):
    """Every tensor of the index, each in the shard the index names, checked."""
    index = read_json(index_path, "the index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in
                                                   weight_map.values()):
        raise ValueError(f"{index_path}: 'weight_map' must map each tensor to a file name")
    shards = {}
    for shard in sorted(set(weight_map.values())):
        if os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise ValueError(f"{index_path}: the shard {shard!r} is not a file name in the "
                             "directory")
        path = os.path.join(directory, shard)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{index_path}: the shard {shard!r} is missing")
        shards[shard] = SafetensorsFile(path)
    files = {}
    for name, shard in weight_map.items():
        if name not in shards[shard]:
            raise ValueError(f"{index_path}: tensor {name!r} is not in its shard {shard!r}")
        files[name] = shards[shard]
    for shard, f in shards.items():
        extra = sorted(set(f.names) - set(weight_map))
        if extra:
            raise ValueError(f"{index_path}: the shard {shard!r} holds {extra[:3]}, which the "
                             "index does not list")
    return files


def open_directory(path: str | os.PathLike) -> tuple[dict, CheckpointTensors]:
    """``(config dict, tensors)`` of a Hugging Face model directory, every file checked.

    Parameters
    ----------
    path : str or os.PathLike
        Holding ``config.json``, and ``model.safetensors`` or
        ``model.safetensors.index.json`` with its shards.

    Returns
    -------
    config : dict
    tensors : CheckpointTensors
        Memory-mapped; close it (or use it as a context manager).

    Raises
    ------
    FileNotFoundError
        Not a directory, no ``config.json``, no weights, or a missing shard.
    ValueError
        A ``config.json`` or index that is not JSON, names a key twice, or
        (``config.json``) lacks a size or gives an absurd one; an index
        naming a tensor its shard lacks; a safetensors file that is not one
        (:class:`~qkvnp.interop.safetensors.SafetensorsError`). Each names its file.
    """
    directory = os.fspath(path)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"from_hf: {directory!r} is not a directory")
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"from_hf: {directory!r} has no config.json")
    config = read_json(config_path, "config.json")
    _check_sizes(config, config_path)
    single = os.path.join(directory, "model.safetensors")
    index_path = single + ".index.json"
    if os.path.isfile(single):  # first, as transformers looks
        f = SafetensorsFile(single)
        return config, CheckpointTensors({name: f for name in f.names}, single)
    if os.path.isfile(index_path):
        files = _open_shards(directory, index_path)
        return config, CheckpointTensors(files, index_path)
    raise FileNotFoundError(f"from_hf: {directory!r} has no model.safetensors or "
                            "model.safetensors.index.json (other formats, .bin or .pth, "
                            "are not read)")

