"""Train a byte-level GPT on text, and write with it (``train --task text``, ``generate``).

Shape key: B batch, T context (tokens), V = 256 byte values, E embedding.

The command line is :mod:`qkvnp.training.text_command`; ``generate``,
:mod:`qkvnp.training.text_generate`.

Tokens are bytes: no tokenizer, no download. Without ``--text`` the corpus
is the running Python's standard-library sources (``*.py`` files at the top
of ``sysconfig.get_paths()["stdlib"]``, sorted by name, read as bytes and
capped at :data:`DEFAULT_CORPUS_BYTES`): every machine has it, nobody's text
ships in the package. The last 10% is held out. Beside the model's loss the
run prints the held-out loss of a bigram model (byte pair counts of the
training split, add-one smoothing) on the same positions: the bar a model
that reads context must clear. Bits per byte are the loss over ``ln 2``.

Checkpoints are those of every training task
(:mod:`qkvnp.training.checkpoint`: one reader, entries checked before any
array is loaded, nothing pickled). ``meta/config`` holds every
:class:`TextConfig` field, ``"task": "text"`` and the corpus' SHA-256;
``meta/rng_state`` the batches' generator; ``meta/generator_states`` the
model's dropout generators and ``"sample"``, the printed samples'; the
history holds each step's loss and learning rate and each held-out loss. A
resume continues the saved run with its saved settings: it equals the run
that never stopped, bit for bit, its printed samples included.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import os
import sys

import numpy as np

from .._checks import check_int
from ..models.generation import generate
from ..models.decoder import Decoder
from ..models.gpt import GPTModel
from ..losses import cross_entropy_backward, cross_entropy_forward
from ..optim import AdamW
from ..interop.tokenizer import ByteTokenizer
from . import text_init
from .checkpoint import HISTORY_FIELDS, Checkpoint, CheckpointError, load_checkpoint
from .config import TASK_DEFAULTS
from .text_family import check_family, decoder_config, describe, family_parameter_floor
from .loop import (SaveError, StopFlag, check_finite, check_run_state, check_save_options,
                   default_checkpoint_path, divergence_guard, save_run)

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Optional

__all__ = ["TextConfig", "DEFAULT_CORPUS_BYTES", "MAXIMA", "default_corpus", "read_text",
           "split_text", "split_tokens", "bigram_loss", "train_text", "read_text_checkpoint",
           "load_text_checkpoint", "text_config_of"]

#: The default corpus' cap: the first this many bytes of the sorted stdlib sources.
DEFAULT_CORPUS_BYTES = 2_000_000
#: Upper bounds of the sizes (far above what the task is for), so that neither a typo nor a
#: checkpoint's configuration makes the task allocate without limit before it says no.
MAXIMA = {"corpus_bytes": 2**31, "context": 2**16, "emb_dim": 2**16, "num_heads": 2**10,
          "num_layers": 2**10, "batch_size": 2**16, "steps": 10**9, "warmup": 10**9,
          "seed": 2**128, "eval_every": 10**9, "eval_windows": 2**20, "sample_every": 10**9,
          "sample_length": 2**20, "kv_heads": 2**10, "window": 2**16, "parameters": 2**31,
          "lora_rank": 2**16}
_LN2 = math.log(2.0)


@dataclasses.dataclass
class TextConfig:
    """Everything a text run depends on (saved in its checkpoints).

    Model: ``context`` (T), ``emb_dim``, ``num_heads``, ``num_layers``,
    ``dropout``, and the attention of recent models in every block, all off
    by default (the book's model): ``kv_heads`` (grouped-query attention),
    ``rope``, ``window`` (each token sees itself and the ``window - 1``
    before it) and ``softcap``; ``family`` (one of
    :data:`~qkvnp.training.text_family.FAMILIES`) trains a
    :class:`~qkvnp.Decoder` of that family's config instead
    (:mod:`qkvnp.training.text_family`); ``init`` (a model directory or llm.c
    file) fine-tunes that model instead, all of it or, with ``lora_rank``,
    adapters on ``lora_targets`` (:mod:`qkvnp.training.text_init`). Optimisation: AdamW with ``lr``,
    ``weight_decay``, linear warm-up over ``warmup`` steps then cosine decay to ``lr / 10`` at ``steps``;
    ``batch_size`` windows a step, drawn at random offsets of the training
    split. ``eval_every`` steps, the held-out loss over ``eval_windows``
    evenly spaced windows; ``sample_every`` steps, a greedy sample of
    ``sample_length`` bytes.
    """

    text: Optional[str] = None
    corpus_bytes: int = DEFAULT_CORPUS_BYTES
    context: int = 64
    emb_dim: int = 64
    num_heads: int = 4
    num_layers: int = 2
    dropout: float = 0.0
    batch_size: int = 16
    steps: int = 2500
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.1
    seed: int = 0
    dtype: str = "float32"
    eval_every: int = 250
    eval_windows: int = 64
    sample_every: int = 500
    sample_length: int = 120
    kv_heads: Optional[int] = None
    rope: bool = False
    window: Optional[int] = None
    softcap: Optional[float] = None
    family: Optional[str] = None
    init: Optional[str] = None
    lora_rank: Optional[int] = None
    lora_targets: Optional[str] = None

    MODEL_FIELDS = ("context", "emb_dim", "num_heads", "num_layers", "dtype", "kv_heads", "rope",
                    "window", "softcap", "family", "init", "lora_rank", "lora_targets")
    #: What a resume may change: none of them changes the trained state (``text``, ``init``:
    #: the same bytes under another name; the checkpoint's SHA-256 of them is compared).
    RESUMABLE_CHANGES = ("text", "init", "steps", "eval_every", "eval_windows", "sample_every",
                         "sample_length")
    # NOTE: not fields: the names the shared loop helpers read (default_checkpoint_path,
    # the divergence message)
    task = "text"
    optimizer = "adamw"

    @classmethod
    def from_dict(cls, values):
        """The checked configuration of exactly the fields' keys (a checkpoint's ``meta/config``).

        Raises ``ValueError`` for a missing or unknown key, and what :meth:`check` raises.
        """
        names = [field.name for field in dataclasses.fields(cls)]
        missing = [name for name in names if name not in values]
        unknown = sorted(str(name) for name in values if name not in names)
        if missing or unknown:
            raise ValueError(f"the text task's settings must have exactly the keys {names}; "
                             f"missing {missing}, unknown {unknown[:5]}")
        return cls(**values).check()

    def check(self):
        """Refuse impossible values with ``ValueError`` or ``TypeError`` naming the option."""
        for name in ("corpus_bytes", "context", "emb_dim", "num_heads", "num_layers",
                     "batch_size", "steps", "eval_every", "eval_windows", "sample_every",
                     "sample_length", "warmup", "seed"):
            check_int(getattr(self, name), _flag(name), 0 if name in ("warmup", "seed") else 1,
                      MAXIMA[name])
        for name in ("kv_heads", "window", "lora_rank"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), _flag(name), 1, MAXIMA[name])
        for name, low, high in (("dropout", 0.0, 1.0), ("lr", 0.0, math.inf),
                                ("weight_decay", 0.0, math.inf), ("softcap", 0.0, math.inf)):
            value = getattr(self, name)
            if value is None and name == "softcap":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise TypeError(f"{_flag(name)} must be a finite number, got {value!r}")
            if not low <= value < high or (value == 0 and name in ("lr", "softcap")):
                kind = {"dropout": "in [0, 1)", "weight_decay": ">= 0",
                        "softcap": "a finite number > 0"}.get(name, "> 0")
                raise ValueError(f"{_flag(name)} must be {kind}, got {value}")
        if not isinstance(self.rope, bool):
            raise TypeError(f"--rope must be true or false, got {self.rope!r}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"--dtype must be float32 or float64, got {self.dtype!r}")
        for name in ("text", "init", "lora_targets"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{_flag(name)} must be a non-empty string, got {value!r}")
        if self.init is not None:
            text_init.check_init_options(self)
            return self
        return self._check_model()

    def _check_model(self):
        if self.emb_dim % self.num_heads:
            raise ValueError(f"--emb-dim must be divisible by --num-heads, got {self.emb_dim} "
                             f"and {self.num_heads}")
        if self.kv_heads is not None and self.num_heads % self.kv_heads:
            raise ValueError(f"--kv-heads must divide --num-heads ({self.num_heads}), got "
                             f"{self.kv_heads}")
        check_family(self)
        if self.rope and (self.emb_dim // self.num_heads) % 2:
            raise ValueError(f"--rope rotates pairs: the head dim --emb-dim / --num-heads must be "
                             f"even, got {self.emb_dim // self.num_heads}")
        if self.lora_rank is not None or self.lora_targets is not None:
            raise ValueError("--lora-rank and --lora-targets adapt a loaded model: give --init")
        if parameter_floor(self) > MAXIMA["parameters"]:
            raise ValueError(f"--emb-dim {self.emb_dim}, --context {self.context} and "
                             f"--num-layers {self.num_layers} make a model of more than "
                             f"{parameter_floor(self):,} parameters (at most "
                             f"{MAXIMA['parameters']:,})")
        return self

    def model_options(self):
        """The :class:`~qkvnp.GPTModel` keywords of the attention options that are on."""
        options = {"num_kv_heads": self.kv_heads, "rope": self.rope or None,
                   "window": None if self.window is None else (self.window - 1, 0),
                   "softcap": self.softcap}
        return {name: value for name, value in options.items() if value is not None}


def _flag(name):
    return "--" + name.replace("_", "-")


def parameter_floor(config):
    """A lower bound of the parameters of ``config``'s model, computed without building it.

    The two 256-row tables (token embedding, output head), the position
    table, and per block the query and output projections and the
    feed-forward layer's two ``E x 4E`` matrices (the key and value
    projections shrink with ``kv_heads``).
    """
    if config.init is not None:
        return 0  # read from its files, which bound it
    if config.family is not None:
        return family_parameter_floor(config)
    width = config.emb_dim
    return 2 * 256 * width + config.context * width + config.num_layers * 10 * width * width


def default_corpus(cap=DEFAULT_CORPUS_BYTES):
    """The running Python's standard-library sources as bytes, and where they came from.

    Deterministic for one Python installation: the ``*.py`` files directly in
    the stdlib directory, sorted by name, concatenated, the first ``cap`` bytes.
    """
    import sysconfig

    directory = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(directory) if n.endswith(".py"))
    chunks, size = [], 0
    for name in names:
        with open(os.path.join(directory, name), "rb") as f:
            chunk = f.read()
        chunks.append(chunk)
        size += len(chunk)
        if size >= cap:
            break
    data = b"".join(chunks)[:cap]
    return data, f"{directory}/*.py ({len(chunks)} files, first {len(data)} bytes)"


def read_text(path):
    """The bytes of a UTF-8 text file; ``ValueError`` if it is not UTF-8 or too short."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--text {path} is not UTF-8 text ({exc})") from None
    return data


def split_text(data, context):
    """``(train, held_out)`` uint8 arrays: the last 10% held out.

    Raises ``ValueError`` unless each part holds more than ``context`` bytes.
    """
    return split_tokens(np.frombuffer(data, dtype=np.uint8), context)


def split_tokens(tokens, context):
    """``(train, held_out)`` of a token array: the last 10% held out (see :func:`split_text`)."""
    cut = len(tokens) - len(tokens) // 10
    train, held = tokens[:cut], tokens[cut:]
    if len(held) <= context + 1:
        raise ValueError(f"the text has {len(tokens)} bytes: its held-out 10% must hold more "
                         f"than --context {context} + 1 of them")
    return train, held


def bigram_loss(train, inputs, targets):
    """Mean ``-ln p(target | input)`` of a byte bigram model fitted on ``train``.

    Counts of byte pairs in ``train`` plus one (add-one smoothing), normalised
    per first byte: ``p(b | a) = (n_ab + 1) / (n_a + 256)``.
    """
    counts = np.ones((256, 256))
    np.add.at(counts, (train[:-1], train[1:]), 1.0)
    log_probs = np.log(counts) - np.log(counts.sum(axis=1, keepdims=True))
    return float(-log_probs[inputs, targets].mean())


def _windows(tokens, starts, context):
    """``(inputs, targets)`` ``(B, T)`` of the windows starting at ``starts``."""
    offsets = np.asarray(starts)[:, None] + np.arange(context)  # (B, T)
    return tokens[offsets].astype(np.int64), tokens[offsets + 1].astype(np.int64)


def _eval_starts(held, config):
    """Evenly spaced window starts over the held-out split (the same every time)."""
    last = len(held) - config.context - 1
    return np.unique(np.linspace(0, last, config.eval_windows).astype(np.int64))


def _lr(config, step):
    """Warm-up then cosine decay to a tenth of ``lr``, for the update of step ``step`` (1-based)."""
    if config.warmup and step <= config.warmup:
        return config.lr * step / config.warmup
    span = max(1, config.steps - config.warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - config.warmup) / span)))
    return config.lr * (0.1 + 0.9 * cosine)


def _model(config):
    if config.init is not None:
        return text_init.load_init_model(config)
    if config.family is not None:
        return Decoder(decoder_config(config), rng=config.seed, dtype=np.dtype(config.dtype))
    return GPTModel(256, config.context, config.emb_dim, config.num_heads, config.num_layers,
                    config.dropout, rng=config.seed, dtype=np.dtype(config.dtype),
                    **config.model_options())


def _held_out_loss(model, held, starts, config):
    model.eval()
    losses = []
    for i in range(0, len(starts), 16):
        inputs, targets = _windows(held, starts[i:i + 16], config.context)
        losses.append(float(cross_entropy_forward(model.forward(inputs), targets)[0])
                      * inputs.size)
    model.train()
    return sum(losses) / (len(starts) * config.context)


def _sample(model, prompt, length, rng, tokenizer):
    """A sample continuing ``prompt`` (token ids), decoded for printing."""
    idx = np.asarray(prompt, dtype=np.int64)[None, :]
    out = generate(model, idx, length, temperature=0.8, top_k=40, rng=rng)
    return tokenizer.decode(out[0, idx.shape[1]:].tolist())


_Corpus = collections.namedtuple("_Corpus", "train held starts baseline source digest tokenizer "
                                            "init_digest")


@dataclasses.dataclass
class _Run:
    """What a text run changes as it goes: the state a checkpoint holds."""

    model: GPTModel | Decoder
    optimizer: AdamW
    data_rng: np.random.Generator
    sample_rng: np.random.Generator
    step: int
    history: dict

    def generators(self):
        """The run's Generators besides the batches': the model's, and the samples'."""
        return {**self.model.generators(), "sample": self.sample_rng}


def _corpus(config, model):
    """The text of ``config`` split, its held-out windows, the bigram baseline and its digest
    (and with ``init``, its tokenizer and the SHA-256 of its files)."""
    if config.text is None:
        data, source = default_corpus(config.corpus_bytes)
    else:
        data, source = read_text(config.text), config.text
    if config.init is None:
        tokenizer, digest = ByteTokenizer(), None
        train, held = split_text(data, config.context)
    else:
        tokenizer = text_init.init_tokenizer(config, model.vocab_size)
        digest = text_init.init_digest(config.init)
        ids = np.asarray(tokenizer.encode(data.decode("utf-8")), dtype=np.int64)
        train, held = split_tokens(ids, config.context)
    starts = _eval_starts(held, config)
    eval_inputs, eval_targets = _windows(held, starts, config.context)
    baseline = (bigram_loss(train, eval_inputs, eval_targets) if config.init is None else
                text_init.token_bigram_loss(train, eval_inputs, eval_targets, model.vocab_size))
    return _Corpus(train, held, starts, baseline, source, hashlib.sha256(data).hexdigest(),
                   tokenizer, digest)


def _config_dict(config, corpus):
    """``meta/config``: every field, the task, and the digests of the text trained on and of
    ``init``'s files."""
    init = {} if corpus.init_digest is None else {"init_sha256": corpus.init_digest}
    return {**dataclasses.asdict(config), "task": "text", "corpus_sha256": corpus.digest, **init}


def text_config_of(saved):
    """``(TextConfig, corpus digest)`` of a text checkpoint's ``meta/config`` (a dict), checked.

    Raises ``ValueError`` or ``TypeError`` naming the key.
    """
    values = dict(saved)
    values.pop("task", None)
    values.setdefault("family", None)  # NOTE: written before families: the book's GPT
    for name in ("init", "lora_rank", "lora_targets"):  # NOTE: written before --init
        values.setdefault(name, None)
    values.pop("init_sha256", None)  # compared by _resume
    digest = values.pop("corpus_sha256", None)
    if not (isinstance(digest, str) and len(digest) == 64
            and all(c in "0123456789abcdef" for c in digest)):
        raise ValueError(f"corpus_sha256 must be 64 hexadecimal digits, got {str(digest)[:80]!r}")
    return TextConfig.from_dict(values), digest


def _layout(saved, file_bytes):
    """``load_checkpoint``'s layout of a text checkpoint of ``file_bytes`` bytes.

    The configuration is checked, and the least its model and optimizer state
    need compared with the file's size, before the model is built to read
    its shapes: a small file cannot make the reader allocate a large model.
    """
    task = saved.get("task")
    if task in TASK_DEFAULTS:
        raise CheckpointError(f"is a checkpoint of train --task {task}, not a text checkpoint "
                              "(train --task text)")
    if task != "text":
        raise ValueError(f"task must be 'text', got {str(task)[:80]!r}")
    config, _ = text_config_of(saved)
    need = 3 * parameter_floor(config) * np.dtype(config.dtype).itemsize  # params, 2 moments
    if need > file_bytes:
        raise CheckpointError(f"holds {file_bytes:,} bytes, but its configuration (meta/config) "
                              f"describes a model whose parameters and optimizer state need at "
                              f"least {need:,}")
    model = _model(config)
    specs = {"param/" + name: (value.shape, value.dtype) for name, value in model.params.items()}
    trained = text_init.trainable_params(model, config)
    specs.update({"optim/" + name: (value.shape, value.dtype)
                  for name, value in AdamW(trained).state_dict().items()})
    return specs, config.steps


def read_text_checkpoint(path):
    """The :class:`~qkvnp.training.checkpoint.Checkpoint` of a text run, every entry checked.

    Read by :func:`qkvnp.training.checkpoint.load_checkpoint` (the reader of
    every task) with the text task's layout: the configuration's types and
    ranges, sizes bounded by the file's own size, the parameters' and
    optimizer entries' names, shapes and dtypes, before any array is loaded.

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    CheckpointError
        Naming the file and the entry (another task's checkpoint included).
    """
    path = os.fspath(path)
    return load_checkpoint(path, lambda saved: _layout(saved, os.stat(path).st_size))


def _checked_states(checkpoint, run):
    """The checkpoint's generator states for ``run``'s generators, checked (see check_run_state)."""
    if "sample" not in checkpoint.generator_states:
        raise CheckpointError(f"{checkpoint.path!r}: entry 'meta/generator_states' lacks "
                              "'sample', the sampling generator's state")
    return check_run_state(checkpoint, run.generators())


def _restore(checkpoint, run):
    """Load ``checkpoint`` into the fresh ``run`` (everything checked first)."""
    states = _checked_states(checkpoint, run)
    try:
        run.model.load_state_dict(checkpoint.params)
        run.optimizer.load_state_dict(checkpoint.optimizer_state)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{checkpoint.path!r}: the parameters (param/) or optimizer "
                              f"entries (optim/) are refused: {exc}") from None
    run.data_rng.bit_generator.state = checkpoint.rng_state
    generators = run.generators()
    for name, state in states.items():
        generators[name].bit_generator.state = state
    run.step, run.history = checkpoint.step, checkpoint.history


def load_text_checkpoint(path):
    """``(model, checkpoint)``: the model of a text checkpoint, and what it holds.

    ``checkpoint`` is what :func:`read_text_checkpoint` gives (``step``,
    ``config``, ``history``, ``optimizer_state``, ...). The model has the
    saved parameters and dropout generators.

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    CheckpointError
        (a ``ValueError``) for a file that is not a usable text checkpoint,
        naming the file and the entry.
    """
    checkpoint = read_text_checkpoint(path)
    run = _fresh_run(text_config_of(checkpoint.config)[0])
    _restore(checkpoint, run)
    return run.model, checkpoint


def _fresh_run(config):
    model = _model(config)
    trained = text_init.trainable_params(model, config)
    return _Run(model, AdamW(trained, lr=config.lr, weight_decay=config.weight_decay),
                np.random.default_rng(config.seed + 1), np.random.default_rng(config.seed + 2),
                0, {key: [] for key in HISTORY_FIELDS})


def _resume(checkpoint, config, corpus, run=None):
    """A run continuing ``checkpoint`` (into ``run``, fresh, if given); ``CheckpointError``
    unless it is ``config``'s run."""
    path = checkpoint.path
    try:
        saved, digest = text_config_of(checkpoint.config)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path!r} holds an invalid configuration (meta/config): "
                              f"{exc}") from None
    differs = [field.name for field in dataclasses.fields(TextConfig)
               if field.name not in TextConfig.RESUMABLE_CHANGES
               and getattr(saved, field.name) != getattr(config, field.name)]
    if differs:
        raise CheckpointError(
            f"--resume {path} was trained with other {', '.join(map(_flag, differs))} ("
            + "; ".join(f"{_flag(name)}: checkpoint {getattr(saved, name)!r}, this run "
                        f"{getattr(config, name)!r}" for name in differs) + ")")
    if digest != corpus.digest:
        raise CheckpointError(f"--resume {path} was trained on another text: {corpus.source} "
                              "is not the text whose SHA-256 meta/config holds")
    if checkpoint.config.get("init_sha256") != corpus.init_digest:
        raise CheckpointError(f"--resume {path} started from other files than --init "
                              f"{config.init} holds now (their SHA-256 differs from "
                              "meta/config's init_sha256): the model it fine-tunes changed")
    if checkpoint.step > config.steps:
        raise CheckpointError(f"--resume {path} is at step {checkpoint.step}, beyond --steps "
                              f"{config.steps} (the total, the saved steps included)")
    run = _fresh_run(config) if run is None else run
    _restore(checkpoint, run)
    return run


def _save(path, config, corpus, run):
    return save_run(path, run.model, run.optimizer, run.step, run.data_rng,
                    _config_dict(config, corpus), run.history,
                    generators=run.generators())


def _eval_rows(history):
    """``[step, mean training loss since the previous evaluation, held-out loss]`` rows."""
    rows, start = [], 0
    for step, held in zip(history["eval_step"], history["eval_loss"]):
        losses = history["loss"][start:step]
        rows.append([step, sum(losses) / len(losses), held])
        start = step
    return rows


def _step(config, corpus, run, stream):
    """One optimizer step; then the evaluation and the sample that fall on it."""
    step = run.step + 1
    lr = _lr(config, step)
    offsets = run.data_rng.integers(0, len(corpus.train) - config.context - 1, config.batch_size)
    inputs, targets = _windows(corpus.train, offsets, config.context)  # (B, T) each
    model = run.model
    with divergence_guard(step, config):
        model.zero_grad()
        loss, cache = cross_entropy_forward(model.forward(inputs), targets)
        model.backward(cross_entropy_backward(1.0, cache))
        check_finite(model, step, config, float(loss))
        run.optimizer.lr = lr
        grads = model.grads
        run.optimizer.step({name: grads[name] for name in run.optimizer.params})
        run.step = step
        for key, value in (("step", step), ("loss", float(loss)), ("accuracy", None),
                           ("lr", lr)):
            run.history[key].append(value)
        if step % config.eval_every == 0 or step == config.steps:
            held_loss = _held_out_loss(model, corpus.held, corpus.starts, config)
            run.history["eval_step"].append(step)
            run.history["eval_loss"].append(held_loss)
            run.history["eval_accuracy"].append(None)
            evaluations = run.history["eval_step"]
            losses = run.history["loss"][evaluations[-2] if len(evaluations) > 1 else 0:]
            train_loss = sum(losses) / len(losses)  # NOTE: as _eval_rows computes it
            unit = _unit(config)
            print(f"step {step:5d}  train {train_loss:.4f} ({train_loss / _LN2:.3f} bits/{unit})"
                  f"  held-out {held_loss:.4f} ({held_loss / _LN2:.3f} bits/{unit})  bigram "
                  f"{corpus.baseline:.4f}  ratio {held_loss / corpus.baseline:.3f}", file=stream)
        if step % config.sample_every == 0 or step == config.steps:
            prompt = corpus.held[:16].tolist()
            text = _sample(model, prompt, config.sample_length, run.sample_rng, corpus.tokenizer)
            print(f"sample at step {step}: {corpus.tokenizer.decode(prompt)!r} -> {text!r}",
                  file=stream)


def _print_header(config, corpus, run, stream):
    unit = _unit(config)
    print(f"text: {corpus.source}; {len(corpus.train)} training {unit}s, {len(corpus.held)} held "
          "out", file=stream)
    options = "".join(f", {name}={value}" for name, value in config.model_options().items())
    model = describe(config) if config.family is not None else (
        f"GPTModel(vocab 256, context {config.context}, width {config.emb_dim}, "
        f"{config.num_heads} heads, {config.num_layers} layers{options})")
    if config.init is not None:
        model = text_init.describe_init(config, run.model, corpus.tokenizer)
    print(f"model: {model}, {run.model.num_parameters()} parameters, {config.dtype}",
          file=stream)
    print(f"schedule: AdamW lr {config.lr:g} (warm-up {config.warmup} steps, cosine to "
          f"{config.lr / 10:g} at step {config.steps}), weight decay {config.weight_decay:g}, "
          f"batch {config.batch_size}"
          + (f"; resumed at step {run.step}" if run.step else ""), file=stream)
    print(f"bigram baseline (add-one smoothing), held-out loss {corpus.baseline:.4f} "
          f"({corpus.baseline / _LN2:.3f} bits/{unit})", file=stream)


def _unit(config):
    return "byte" if config.init is None else "token"


def train_text(config, *, resume=None, save=None, save_every=None, stream=None, stop_at=None,
               save_on_interrupt=True, save_hf=None):
    """Train; print progress to ``stream``; return ``(model, rows, exit_code)``.

    ``rows``: ``[step, train_loss, held_loss]`` at each evaluation, from step
    1 (a resumed run's included). The exit code is 0, or 130/143 after
    SIGINT/SIGTERM. ``resume``: a path, or what :func:`read_text_checkpoint`
    gave; its settings must equal ``config``'s except
    ``TextConfig.RESUMABLE_CHANGES``, and the text must be the one it was
    trained on. ``save``: written at the end, and every ``save_every``
    steps; checked before the first step (as for the other tasks).
    Stopped early (a signal, or ``stop_at``: stop after that step, the
    schedule still aiming at ``config.steps``), the run saves to ``save``,
    or without it to ``default_checkpoint_path`` unless ``save_on_interrupt``
    is False, and prints how to resume. ``save_hf``: a directory where a run
    that finishes writes its Decoder (``--family`` or ``init``) as
    transformers loads it, adapters merged (:func:`~qkvnp.training.text_init.write_hf`).

    Raises
    ------
    CheckpointError
        A ``resume`` that is unreadable or another run's; nothing is trained.
    ValueError, TypeError, OSError
        A bad ``config``, ``save`` or ``save_every``, or an unreadable
        text; nothing is trained.
    FloatingPointError
        If the run diverges (the loss or a gradient not finite).
    SaveError
        If a checkpoint cannot be written.
    """
    from ..apps.cli import program_name
    from ..kernels import blas_threads, num_threads

    stream = sys.stdout if stream is None else stream
    config.check()
    save, save_every = check_save_options(save, save_every)
    if save_hf is not None and config.family is None and config.init is None:
        raise ValueError("--save-hf writes a Decoder: give --family or --init (the book's "
                         "GPTModel has no transformers class)")
    save_hf = text_init.check_save_hf(save_hf)
    if resume is not None and not isinstance(resume, Checkpoint):
        resume = read_text_checkpoint(resume)
    run = _fresh_run(config) if config.init is not None else None  # the tokenizer needs it
    corpus = _corpus(config, run and run.model)
    run = (run or _fresh_run(config)) if resume is None else _resume(resume, config, corpus, run)
    _print_header(config, corpus, run, stream)
    with StopFlag(save is not None or save_on_interrupt) as stop, blas_threads(1), \
            num_threads(1), np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        run.model.train()
        while run.step < config.steps and not stop.requested:
            _step(config, corpus, run, stream)
            if save_every is not None and run.step % save_every == 0 and run.step < config.steps:
                _save(save, config, corpus, run)
            if stop_at is not None and run.step >= stop_at:
                break
        interrupted = run.step < config.steps
        path = save
        if path is None and interrupted and save_on_interrupt:
            path = default_checkpoint_path(config, run.step)
        if path is not None:
            _save(path, config, corpus, run)
            print(f"saved {path} at step {run.step}", file=stream)
    if interrupted and path is not None:
        print(f"interrupted: resume with {program_name()} train --task text --resume {path}"
              + (f" --save {save}" if save else ""), file=stream)
    if save_hf is not None and not interrupted:
        text_init.write_hf(run.model, config, save_hf)
        print(f"wrote {save_hf} (transformers' from_pretrained reads it)", file=stream)
    code = 128 + int(stop.signal) if interrupted and stop.requested else 0
    return run.model, _eval_rows(run.history), code
