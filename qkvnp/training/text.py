"""Train a byte-level GPT on text, and write with it (``train --task text``, ``generate``).

Shape key: B batch, T context (tokens), V = 256 byte values, E embedding.

Tokens are bytes: no tokenizer, no download. Without ``--text`` the corpus
is the running Python's standard-library sources (``*.py`` files at the top
of ``sysconfig.get_paths()["stdlib"]``, sorted by name, read as bytes and
capped at :data:`DEFAULT_CORPUS_BYTES`): every machine has it, nobody's text
ships in the package. The last 10% is held out. Beside the model's loss the
run prints the held-out loss of a bigram model (byte pair counts of the
training split, add-one smoothing) on the same positions: the bar a model
that reads context must clear. Bits per byte are the loss over ``ln 2``.

Checkpoints are ``.npz`` archives read back without pickle: the parameters
(``param/<name>``), the AdamW state (``opt/<key>``) and a JSON ``meta``
entry (the configuration, the step, the Generators' states, the history).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import numpy as np

from ..generation import generate
from ..gpt import GPTModel
from ..losses import cross_entropy_backward, cross_entropy_forward
from ..optim import AdamW
from .checkpoint import write_npz_atomic
from .loop import StopFlag

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Optional

__all__ = ["TextConfig", "DEFAULT_CORPUS_BYTES", "default_corpus", "read_text", "split_text",
           "bigram_loss", "train_text", "save_text_checkpoint", "load_text_checkpoint",
           "add_arguments", "run", "FORMAT"]

#: What ``train --task text --help`` opens with (plain text: ``__doc__`` is None under -OO).
DESCRIPTION = ("Train a byte-level GPT (the book's GPTModel) on text by gradient descent, with "
               "hand-derived gradients, beside a bigram baseline.")

#: The default corpus' cap: the first this many bytes of the sorted stdlib sources.
DEFAULT_CORPUS_BYTES = 2_000_000
#: The checkpoint's format tag (its ``meta["format"]``).
FORMAT = "qkvnp-text-gpt-1"
_LN2 = math.log(2.0)


@dataclasses.dataclass
class TextConfig:
    """Everything a text run depends on (saved in its checkpoints).

    Model: ``context`` (T), ``emb_dim``, ``num_heads``, ``num_layers``,
    ``dropout``, and the attention of recent models in every block, all off
    by default (the book's model): ``kv_heads`` (grouped-query attention),
    ``rope``, ``window`` (each token sees itself and the ``window - 1``
    before it) and ``softcap``. Optimisation: AdamW with ``lr``, ``weight_decay``, linear
    warm-up over ``warmup`` steps then cosine decay to ``lr / 10`` at ``steps``;
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

    MODEL_FIELDS = ("context", "emb_dim", "num_heads", "num_layers", "dtype", "kv_heads", "rope",
                    "window", "softcap")

    def check(self):
        """Refuse impossible values with ``ValueError`` naming the option."""
        for name in ("corpus_bytes", "context", "emb_dim", "num_heads", "num_layers",
                     "batch_size", "steps", "eval_every", "eval_windows", "sample_every",
                     "sample_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.emb_dim % self.num_heads:
            raise ValueError(f"--emb-dim must be divisible by --num-heads, got {self.emb_dim} "
                             f"and {self.num_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if not self.lr > 0 or self.weight_decay < 0 or self.warmup < 0:
            raise ValueError("--lr must be > 0, --weight-decay and --warmup >= 0")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"--dtype must be float32 or float64, got {self.dtype!r}")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.num_heads % self.kv_heads):
            raise ValueError(f"--kv-heads must divide --num-heads ({self.num_heads}), got "
                             f"{self.kv_heads}")
        if self.rope and (self.emb_dim // self.num_heads) % 2:
            raise ValueError(f"--rope rotates pairs: the head dim --emb-dim / --num-heads must be "
                             f"even, got {self.emb_dim // self.num_heads}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"--window must be >= 1 (the tokens each one sees, itself "
                             f"included), got {self.window}")
        if self.softcap is not None and not 0.0 < self.softcap < math.inf:
            raise ValueError(f"--softcap must be a finite number > 0, got {self.softcap}")
        return self

    def model_options(self):
        """The :class:`~qkvnp.GPTModel` keywords of the attention options that are on."""
        options = {"num_kv_heads": self.kv_heads, "rope": self.rope or None,
                   "window": None if self.window is None else (self.window - 1, 0),
                   "softcap": self.softcap}
        return {name: value for name, value in options.items() if value is not None}


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
    tokens = np.frombuffer(data, dtype=np.uint8)
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


def _sample(model, prompt, length, rng):
    """A sample continuing ``prompt`` (bytes), decoded for printing."""
    idx = np.frombuffer(prompt, dtype=np.uint8).astype(np.int64)[None, :]
    out = generate(model, idx, length, temperature=0.8, top_k=40, rng=rng)
    return bytes(out[0, idx.shape[1]:].astype(np.uint8).tolist()).decode("utf-8", "replace")


def _meta(config, step, data_rng, model, history, source, running):
    return {"format": FORMAT, "config": dataclasses.asdict(config), "step": step,
            "running": running,
            "data_rng": data_rng.bit_generator.state, "source": source,
            "generators": {name: g.bit_generator.state for name, g in model.generators().items()},
            "history": history}


def save_text_checkpoint(path, model, optimizer, meta):
    """Write a checkpoint atomically (nothing pickled)."""
    arrays = {f"param/{name}": value for name, value in model.params.items()}
    arrays.update({f"opt/{key}": value for key, value in optimizer.state_dict().items()})
    arrays["meta"] = np.array(json.dumps(meta))
    return write_npz_atomic(path, arrays)


def load_text_checkpoint(path):
    """``(model, meta, optimizer_state)`` from a checkpoint of :func:`train_text`.

    Raises ``ValueError`` for a file that is not such a checkpoint.
    """
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
        meta = json.loads(str(arrays.pop("meta")))
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"{path} is not a qkvnp text checkpoint ({exc})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a qkvnp text checkpoint (format "
                         f"{meta.get('format')!r}, expected {FORMAT!r})")
    config = TextConfig(**meta["config"]).check()
    model = _model(config)
    params = {name[len("param/"):]: value for name, value in arrays.items()
              if name.startswith("param/")}
    model.load_state_dict(params)  # checks names, shapes, finiteness
    for name, generator in model.generators().items():
        generator.bit_generator.state = meta["generators"][name]
    optimizer_state = {name[len("opt/"):]: value for name, value in arrays.items()
                       if name.startswith("opt/")}
    return model, meta, optimizer_state


def train_text(config, *, resume=None, save=None, save_every=None, stream=None, stop_at=None):
    """Train; print progress to ``stream``; return ``(model, history, exit_code)``.

    ``history`` is a list of ``[step, train_loss, held_loss]`` rows; the exit
    code is 0, or 130/143 after SIGINT/SIGTERM (a checkpoint is saved first
    when ``save`` is given). ``stop_at``: stop after that step as a signal
    would (exit code 0), the schedule still aiming at ``config.steps``.
    """
    from ..kernels import blas_threads, num_threads

    stream = sys.stdout if stream is None else stream
    config.check()
    if config.text is None:
        data, source = default_corpus(config.corpus_bytes)
    else:
        data, source = read_text(config.text), config.text
    train, held = split_text(data, config.context)
    starts = _eval_starts(held, config)
    eval_inputs, eval_targets = _windows(held, starts, config.context)
    baseline = bigram_loss(train, eval_inputs, eval_targets)
    data_rng = np.random.default_rng(config.seed + 1)
    history, step, running = [], 0, []  # running: the train losses since the last evaluation
    model = _model(config)
    optimizer = AdamW(model.params, lr=config.lr, weight_decay=config.weight_decay)
    if resume is not None:
        model, meta, optimizer_state = load_text_checkpoint(resume)
        saved = TextConfig(**meta["config"])
        differs = [f for f in TextConfig.MODEL_FIELDS + ("text", "corpus_bytes", "seed")
                   if getattr(saved, f) != getattr(config, f)]
        if differs:
            raise ValueError(f"--resume {resume} was trained with other "
                             f"{', '.join('--' + f.replace('_', '-') for f in differs)}")
        optimizer = AdamW(model.params, lr=config.lr, weight_decay=config.weight_decay)
        optimizer.load_state_dict(optimizer_state)
        data_rng.bit_generator.state = meta["data_rng"]
        step, history, running = meta["step"], meta["history"], meta["running"]
    print(f"text: {source}; {len(train)} training bytes, {len(held)} held out", file=stream)
    options = "".join(f", {name}={value}" for name, value in config.model_options().items())
    print(f"model: GPTModel(vocab 256, context {config.context}, width {config.emb_dim}, "
          f"{config.num_heads} heads, {config.num_layers} layers{options}), "
          f"{model.num_parameters()} parameters, {config.dtype}", file=stream)
    print(f"schedule: AdamW lr {config.lr:g} (warm-up {config.warmup} steps, cosine to "
          f"{config.lr / 10:g} at step {config.steps}), weight decay {config.weight_decay:g}, "
          f"batch {config.batch_size}"
          + (f"; resumed at step {step}" if step else ""), file=stream)
    print(f"bigram baseline (add-one smoothing), held-out loss {baseline:.4f} "
          f"({baseline / _LN2:.3f} bits/byte)", file=stream)
    prompt = bytes(held[:16].tolist())
    sample_rng = np.random.default_rng(config.seed + 2)
    code = 0
    # NOTE: the other tasks' handling: a first signal stops after the step (and saves),
    # a second one stops at once
    with StopFlag(save is not None) as stop, blas_threads(1), num_threads(1):
        model.train()
        while step < config.steps:
            offsets = data_rng.integers(0, len(train) - config.context - 1, config.batch_size)
            inputs, targets = _windows(train, offsets, config.context)  # (B, T) each
            model.zero_grad()
            loss, cache = cross_entropy_forward(model.forward(inputs), targets)
            model.backward(cross_entropy_backward(1.0, cache))
            step += 1
            optimizer.lr = _lr(config, step)
            optimizer.step(model.grads)
            running.append(float(loss))
            if not math.isfinite(running[-1]):
                raise FloatingPointError(f"the training loss is {running[-1]} at step {step}: "
                                         "lower --lr")
            if step % config.eval_every == 0 or step == config.steps:
                train_loss = sum(running) / len(running)
                running = []
                held_loss = _held_out_loss(model, held, starts, config)
                history.append([step, train_loss, held_loss])
                print(f"step {step:5d}  train {train_loss:.4f} ({train_loss / _LN2:.3f} bits/byte)"
                      f"  held-out {held_loss:.4f} ({held_loss / _LN2:.3f} bits/byte)  "
                      f"bigram {baseline:.4f}  ratio {held_loss / baseline:.3f}", file=stream)
            if step % config.sample_every == 0 or step == config.steps:
                text = _sample(model, prompt, config.sample_length, sample_rng)
                print(f"sample at step {step}: {prompt.decode('utf-8', 'replace')!r} -> "
                      f"{text!r}", file=stream)
            if save is not None and save_every and step % save_every == 0:
                save_text_checkpoint(save, model, optimizer,
                                     _meta(config, step, data_rng, model, history, source, running))
            if stop.requested:
                code = 128 + int(stop.signal)
                break
            if stop_at is not None and step >= stop_at:
                break
    if save is not None:
        save_text_checkpoint(save, model, optimizer,
                             _meta(config, step, data_rng, model, history, source, running))
        print(f"saved {save} at step {step}", file=stream)
    return model, history, code


def add_arguments(parser):
    """The options of ``train --task text`` (its own parser: see :func:`run`)."""
    defaults = TextConfig()
    parser.add_argument("--task", choices=("text",), required=True)
    parser.add_argument("--text", metavar="FILE", default=None,
                        help="a UTF-8 file to train on (default: this Python's stdlib sources)")
    for name, kind, help_text in (
            ("corpus_bytes", int, "cap of the default corpus"),
            ("context", int, "tokens (bytes) a window holds"),
            ("emb_dim", int, "width"), ("num_heads", int, "heads"),
            ("num_layers", int, "blocks"), ("dropout", float, "drop rate"),
            ("batch_size", int, "windows per step"), ("steps", int, "optimizer steps"),
            ("lr", float, "peak learning rate"), ("warmup", int, "warm-up steps"),
            ("weight_decay", float, "AdamW weight decay"), ("seed", int, "seed"),
            ("eval_every", int, "held-out evaluation period"),
            ("eval_windows", int, "held-out windows"),
            ("sample_every", int, "sample period"), ("sample_length", int, "sample bytes")):
        parser.add_argument("--" + name.replace("_", "-"), type=kind,
                            default=getattr(defaults, name),
                            help=f"{help_text} (default {getattr(defaults, name)})")
    parser.add_argument("--dtype", choices=("float32", "float64"), default=defaults.dtype)
    parser.add_argument("--kv-heads", type=int, metavar="K", default=None,
                        help="grouped-query attention: K key/value heads, a divisor of "
                             "--num-heads (default: one per head)")
    parser.add_argument("--rope", action="store_true",
                        help="rotary positions in every head (besides the learned table)")
    parser.add_argument("--window", type=int, metavar="W", default=None,
                        help="sliding-window attention: each token sees itself and the W - 1 "
                             "before it (default: the whole context)")
    parser.add_argument("--softcap", type=float, metavar="S", default=None,
                        help="soft-cap the scores: S tanh(scores / S) (default: none)")
    parser.add_argument("--save", metavar="PATH", default=None, help="checkpoint path (.npz)")
    parser.add_argument("--save-every", type=int, metavar="N", default=None)
    parser.add_argument("--resume", metavar="PATH", default=None)


def run(args):
    """Run ``train --task text``; return the exit code."""
    fields = {f.name for f in dataclasses.fields(TextConfig)}
    config = TextConfig(**{k: v for k, v in vars(args).items() if k in fields})
    try:
        config.check()
        *_, code = train_text(config, resume=args.resume, save=args.save,
                              save_every=args.save_every)
    except (ValueError, OSError) as exc:
        raise argparse.ArgumentError(None, str(exc)) from None
    return code
