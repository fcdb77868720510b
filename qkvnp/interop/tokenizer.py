"""A Hugging Face directory's tokenizer, run by the ``tokenizers`` package (the ``hf`` extra).

Shape key: T tokens.

:class:`Tokenizer` reads ``tokenizer.json`` with Hugging Face's
``tokenizers`` (imported when a tokenizer is loaded, never at ``import
qkvnp``; ``pip install 'qkvnp[hf]'``): qkvnp writes no BPE of its own. The
special tokens come from the files transformers reads, the first that names
them: ``generation_config.json``, ``tokenizer_config.json``, ``config.json``
(``bos_token_id``/``eos_token_id``, or ``bos_token``/``eos_token`` looked up
in the vocabulary). The chat template is ``tokenizer_config.json``'s
``chat_template`` (or a ``chat_template.jinja`` file), a Jinja template that
:meth:`Tokenizer.apply_chat_template` renders with ``jinja2`` (in the same
extra), as transformers does; without ``jinja2`` it refuses, naming it.

:class:`ByteTokenizer` is the tokenizer of a byte model (vocabulary 256: the
text task's models, llm.c's files fed raw bytes): UTF-8 bytes in, bytes out.

:class:`StreamDecoder` turns token ids into text as they come, holding back
the bytes of a character that is not complete yet.
"""
from __future__ import annotations

import json
import os

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any, Iterable, Optional, Sequence

__all__ = ["Tokenizer", "ByteTokenizer", "StreamDecoder", "MissingExtraError", "load_tokenizer"]

_EXTRA = "pip install 'qkvnp[hf]'"


class MissingExtraError(ImportError):
    """An optional package (of the ``hf`` extra) is needed and not installed; names it."""


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise MissingExtraError(f"reading tokenizer.json needs Hugging Face's 'tokenizers' "
                                f"package, which is not installed: {_EXTRA}") from None
    return tokenizers


def _read_json(path):
    """The JSON object of ``path``, ``{}`` if it does not exist; ``ValueError`` naming it."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _token_text(value):
    """A special token's text: a string, or transformers' ``{"content": ...}`` (AddedToken)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A directory's ``tokenizer.json``, its special tokens and chat template.

    Parameters
    ----------
    path : str or os.PathLike
        A directory holding ``tokenizer.json`` (as transformers'
        ``save_pretrained`` writes it), or that file.

    Attributes
    ----------
    vocab_size : int
        The ids the tokenizer can give, added tokens included.
    bos_id, eos_id : int or None
        The special tokens (see the module's docstring for where they come from).
    eos_ids : tuple of int
        Every end token (``generation_config.json`` may list several).
    chat_template : str or None

    Raises
    ------
    FileNotFoundError
        If there is no ``tokenizer.json`` (naming the path).
    MissingExtraError
        (an ``ImportError``) if ``tokenizers`` is not installed, naming the extra.
    ValueError
        If a file is not what it should be, naming it.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = os.fspath(path)
        directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{directory} has no tokenizer.json (the tokenizer a "
                                    "Hugging Face directory keeps)")
        tokenizers = _import_tokenizers()
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(file)
        except Exception as exc:  # the Rust side raises its own Exception type
            raise ValueError(f"{file} is not a tokenizer the tokenizers package reads: "
                             f"{exc}") from None
        self.path = directory
        self.vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        configs = [_read_json(os.path.join(directory, name)) for name in
                   ("generation_config.json", "tokenizer_config.json", "config.json")]
        self.bos_id = self._special(configs, "bos")
        eos = self._special(configs, "eos", many=True)
        self.eos_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, list) else (
            () if eos is None else (eos,))
        self.eos_id = self.eos_ids[0] if self.eos_ids else None
        self.chat_template = self._template(directory, configs[1])

    def _special(self, configs, kind, many=False):
        """The first id named by ``<kind>_token_id`` or ``<kind>_token`` in ``configs``."""
        for config in configs:
            value = config.get(f"{kind}_token_id")
            if isinstance(value, list) and many and value and all(
                    isinstance(v, int) for v in value):
                return [int(v) for v in value]
            if isinstance(value, int) and not isinstance(value, bool):
                return int(value)
            text = _token_text(config.get(f"{kind}_token"))
            if text is not None and self._tokenizer.token_to_id(text) is not None:
                return int(self._tokenizer.token_to_id(text))
        return None

    @staticmethod
    def _template(directory, tokenizer_config):
        template = tokenizer_config.get("chat_template")
        if isinstance(template, list):  # named templates: transformers takes "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = os.path.join(directory, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        return template if isinstance(template, str) else None

    def __repr__(self) -> str:
        return (f"Tokenizer({self.path!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id})")

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The ids of ``text`` (T,); with ``add_special_tokens``, the tokenizer's post-processor's
        (a BOS, say) as transformers' ``encode`` adds them."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``."""
        return str(self._tokenizer.decode([int(i) for i in ids],
                                          skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: Sequence[dict[str, str]], *,
                            add_generation_prompt: bool = True) -> str:
        """The text of ``messages`` (``[{"role": "user", "content": "..."}]``) through the
        chat template, rendered with ``jinja2`` as transformers renders it.

        Raises
        ------
        ValueError
            If the directory has no chat template.
        MissingExtraError
            If ``jinja2`` is not installed, naming the extra.
        """
        if self.chat_template is None:
            raise ValueError(f"{self.path} has no chat template (tokenizer_config.json's "
                             "chat_template, or chat_template.jinja)")
        try:
            import jinja2.sandbox
        except ImportError:
            raise MissingExtraError(f"a chat template is a Jinja template, and rendering it "
                                    f"needs 'jinja2', which is not installed: {_EXTRA}") from None

        def raise_exception(message):
            raise ValueError(f"the chat template of {self.path} refused the messages: {message}")

        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True,
                                                                   lstrip_blocks=True)
        environment.globals["raise_exception"] = raise_exception
        names = {name: self._tokenizer.id_to_token(i) for name, i in
                 (("bos_token", self.bos_id), ("eos_token", self.eos_id)) if i is not None}
        return environment.from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **names)


class ByteTokenizer:
    """The tokenizer of a byte model: a text's UTF-8 bytes are its ids (vocabulary 256).

    Examples
    --------
    >>> tokenizer = ByteTokenizer()
    >>> tokenizer.encode("né"), tokenizer.decode([110, 195, 169])
    ([110, 195, 169], 'né')
    """

    vocab_size = 256
    bos_id = eos_id = None
    eos_ids: tuple[int, ...] = ()
    chat_template = None
    path = None

    def __repr__(self) -> str:
        return "ByteTokenizer()"

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """``ids`` as bytes, decoded as UTF-8 (an invalid sequence becomes U+FFFD)."""
        return bytes(int(i) for i in ids).decode("utf-8", "replace")

    def apply_chat_template(self, messages: Any, *, add_generation_prompt: bool = True) -> str:
        """Refused: a byte model has no chat template."""
        raise ValueError("a byte model has no chat template")


class StreamDecoder:
    """Text of token ids given one at a time, each character printed once, whole.

    ``push(ids)`` returns the text that the ids so far add: the decode of
    everything pushed, minus what was returned before, holding back a tail
    that ends in U+FFFD (the first bytes of a character whose last bytes are
    still to come). The concatenation of every ``push`` and the final
    :meth:`flush` is ``tokenizer.decode(all ids)``.

    Parameters
    ----------
    tokenizer : Tokenizer or ByteTokenizer
    prefix : sequence of int, optional
        Ids already shown (the prompt): decoded with the new ones, so that a
        token's leading space or a character split across the prompt's end
        comes out right, but not returned.

    Examples
    --------
    >>> stream = StreamDecoder(ByteTokenizer())
    >>> [stream.push([b]) for b in "é!".encode()] + [stream.flush()]
    ['', 'é', '!', '']
    """

    def __init__(self, tokenizer: Any, prefix: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids = [int(i) for i in prefix]
        self.shown = len(tokenizer.decode(self.ids)) if self.ids else 0

    def push(self, ids: Iterable[int]) -> str:
        """The new text that ``ids`` complete (may be empty)."""
        self.ids.extend(int(i) for i in ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.shown = text[self.shown:], len(text)
        return new

    def flush(self) -> str:
        """What is held back (an incomplete character's U+FFFD), at the end."""
        text = self.tokenizer.decode(self.ids)
        new, self.shown = text[self.shown:], len(text)
        return new


def load_tokenizer(path: str | os.PathLike[str], vocab_size: Optional[int] = None) -> Any:
    """The tokenizer of a model directory: its ``tokenizer.json``, or bytes for a byte model.

    Parameters
    ----------
    path : str or os.PathLike
        A directory (or a ``tokenizer.json``).
    vocab_size : int, optional
        The model's vocabulary: a directory without ``tokenizer.json`` whose
        model has 256 ids is a byte model (:class:`ByteTokenizer`).

    Raises
    ------
    FileNotFoundError
        No ``tokenizer.json``, and not a byte model: the message says so and
        names ``--ids`` for the command line.
    MissingExtraError, ValueError
        As :class:`Tokenizer`.
    """
    path = os.fspath(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file) and vocab_size == 256:
        return ByteTokenizer()
    return Tokenizer(path)
