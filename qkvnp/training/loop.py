"""Train attention projections by gradient descent, with hand-derived gradients only.

Shape key: B batch, P stored key/value pairs, T sequence length, E embedding,
V value vocabulary.

``python -m qkvnp train`` trains the ``kv-recall`` model (the default task,
or ``partner``, its asymmetric variant) or the ``teacher`` task's student, prints a live progress line and a final
summary, and can save, resume and plot a run::

    python -m qkvnp train                              # kv-recall, ~1000 steps
    python -m qkvnp train --task partner               # answer with the partner key's value
    python -m qkvnp train --task teacher               # student learns a random teacher
    python -m qkvnp train --steps 300 --save run.npz   # stop at step 300 ...
    python -m qkvnp train --steps 1000 --resume run.npz --save run.npz  # ... go on to 1000

The library entry point is :func:`train` (``train(TrainConfig(...))``), which
returns a :class:`TrainResult` and prints nothing unless given a callback.

Determinism: a run is a pure function of its configuration. Every random
draw comes from :func:`qkvnp.training.tasks.make_streams` (``seed``), and a checkpoint
stores the parameters, the optimizer state, the step, the state of the
training-batch generator and the history so far, so that a run interrupted
and resumed ends with parameters bitwise equal to those of a run that never
stopped, and with the same history.

The command's progress line, summary and plot live in :mod:`qkvnp.training.report`.

Resuming: the checkpoint stores the run's configuration, ``steps`` included,
which is also the horizon of the cosine schedule. Resumed with the same
``steps`` (a run stopped by Ctrl-C, SIGTERM, or between ``save_every``
checkpoints), the run ends bitwise identical to one that never stopped.
Resumed with another ``steps`` (to extend a finished run), the learning rate
follows the new horizon's schedule from the checkpoint's step on: the result
is then neither run's; ``python -m qkvnp train`` says so in one line.

Ctrl-C or SIGTERM (what a job scheduler sends before it kills a job) stops
the run at the end of the current step and saves a checkpoint (to
``save``, or to a default path that is printed); the command exits with 130
or 143. A second signal aborts at once without saving.

The command line itself is :mod:`qkvnp.training.command`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
import signal
import sys
import threading
import time
from collections import namedtuple

import numpy as np

from .._checks import check_int
from .._io import check_writable
from .checkpoint import (HISTORY_FIELDS, Checkpoint, CheckpointError, load_checkpoint,
                         save_checkpoint)
from .config import LOOKUP_TASKS, RESUMABLE_CHANGES, TrainConfig

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any, Callable

__all__ = [
    "TrainConfig",
    "StopFlag",
    "TrainResult",
    "SaveError",
    "train",
    "build_model",
    "build_task",
    "build_optimizer",
    "scheduled_lr",
    "evaluate",
    "checkpoint_layout",
    "check_resume",
    "default_checkpoint_path",
    "check_run_state",
    "check_save_options",
    "save_run",
    "divergence_guard",
    "check_finite",
]

TrainResult = namedtuple(
    "TrainResult",
    "config model optimizer task step start_step history heldout initial_heldout seconds "
    "interrupted checkpoint signal",
)
TrainResult.__doc__ = """What :func:`train` returns.

Fields: ``config`` (the resolved :class:`TrainConfig`), ``model``,
``optimizer``, ``task``, ``step`` (steps taken in total), ``start_step`` (the
step this session started from: the checkpoint's with ``resume``, else 0),
``history`` (dict of lists: ``step, loss, accuracy, lr`` per step;
``eval_step, eval_loss, eval_accuracy`` per evaluation; from step 1, the
steps before a ``resume`` included; ``accuracy`` and ``eval_accuracy`` hold
None for the teacher task), ``heldout`` (final held-out metrics, dict
``loss``, ``accuracy``), ``initial_heldout`` (the held-out metrics of the
initial weights), ``seconds`` (wall time of this session's training loop),
``interrupted`` (True after Ctrl-C or SIGTERM), ``checkpoint`` (path written
at the end, or None), ``signal`` (the ``signal.Signals`` that stopped the run,
or None).
"""


class SaveError(OSError):
    """A checkpoint could not be written; the file at that path is as it was before."""


# ---------------------------------------------------------------- building blocks


def build_task(config, rng):
    """The task of ``config`` (``rng``: the teacher's weights or the partner pairing; unused by kv-recall)."""
    from .tasks import KVRecallTask, PartnerTask, TeacherTask

    if config.task == "kv-recall":
        return KVRecallTask(config.num_keys, config.num_values, config.num_pairs)
    if config.task == "partner":
        return PartnerTask(config.num_keys, config.num_values, config.num_pairs, rng=rng)
    return TeacherTask(config.embed_dim, config.num_heads, config.seq_len, rng=rng,
                       dtype=np.dtype(config.dtype))


def build_model(config, rng):
    """The model of ``config``, initialised from ``rng``."""
    from .models import AttentionRegressor, KVRecallModel

    if config.task in LOOKUP_TASKS:  # the same model: only the data differ
        return KVRecallModel(config.num_keys, config.num_values, config.dim,
                             variant=config.variant, rng=rng, dtype=np.dtype(config.dtype),
                             dropout=config.dropout)
    return AttentionRegressor(config.embed_dim, config.num_heads, rng=rng,
                              dtype=np.dtype(config.dtype), dropout=config.dropout)


def build_optimizer(config, params):
    """The optimizer of ``config`` over ``params`` (updated in place)."""
    from ..optim import SGD, Adam, AdamW

    if config.optimizer == "sgd":
        return SGD(params, config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    cls = Adam if config.optimizer == "adam" else AdamW
    return cls(params, config.lr, weight_decay=config.weight_decay)


def scheduled_lr(config, step):
    """Learning rate of the 1-based ``step`` under ``config``'s schedule.

    ``constant``: ``lr``. ``cosine``: ``lr * min(1, step / warmup) *
    (1 + cos(pi * (step - 1) / steps)) / 2``, positive for every step of the run.

    >>> config = TrainConfig(lr=1.0, steps=100, warmup=10).resolved()
    >>> scheduled_lr(config, 5), round(scheduled_lr(config, 51), 3)
    (0.5, 0.5)
    """
    if config.schedule == "constant":
        return config.lr
    warm = min(1.0, step / config.warmup) if config.warmup else 1.0
    progress = min(step - 1, config.steps - 1) / config.steps
    return config.lr * warm * 0.5 * (1.0 + math.cos(math.pi * progress))


def _forward(model, batch, return_weights=False):
    if hasattr(batch, "keys"):
        return model.forward(batch.keys, batch.values, batch.query, return_weights=return_weights)
    return model.forward(batch.x, return_weights=return_weights)


def _loss(task, out, batch):
    """``(loss, accuracy or None, dout)`` of ``out`` against ``batch.target``."""
    from ..losses import (accuracy, cross_entropy_backward, cross_entropy_forward, mse_backward,
                         mse_forward)

    if task.kind == "classification":
        loss, cache = cross_entropy_forward(out, batch.target)
        return float(loss), accuracy(out, batch.target), cross_entropy_backward(1.0, cache)
    loss, cache = mse_forward(out, batch.target)
    return float(loss), None, mse_backward(1.0, cache)


def evaluate(model, task, batch):
    """Held-out metrics of ``model`` on ``batch``: dict ``loss`` and ``accuracy``.

    ``accuracy`` is None for the (regression) teacher task. The model runs in
    evaluation mode (no dropout), then goes back to its mode.
    """
    training = model.training
    model.eval()
    try:
        out = _forward(model, batch)
    finally:
        model.train(training)
    loss, acc, _ = _loss(task, out, batch)
    return {"loss": loss, "accuracy": acc}


# ---------------------------------------------------------------- Ctrl-C and SIGTERM


class StopFlag:
    """SIGINT or SIGTERM sets a flag checked between steps; a second signal raises at once.

    Only installed in the main thread (signal handlers cannot be set elsewhere).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, saving=True):
        self.signal = None
        self.saving = saving
        self._previous = {}

    @property
    def requested(self):
        return self.signal is not None

    def _handler(self, signum, frame):
        if self.requested:
            from ..apps.cli import Interrupted

            raise KeyboardInterrupt if signum == signal.SIGINT else Interrupted(signum)
        self.signal = signal.Signals(signum)
        name = "Ctrl-C" if signum == signal.SIGINT else self.signal.name
        if self.saving:
            sys.stderr.write(f"\n{name}: stopping after this step and saving a checkpoint "
                             f"({name} again aborts without saving)\n")
        else:
            sys.stderr.write(f"\n{name}: stopping after this step ({name} again stops at "
                             "once)\n")
        sys.stderr.flush()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handler)
        return self

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        return False


def _blas_single_thread():
    """Pin BLAS to one thread during training (when numpy's OpenBLAS can be found).

    NOTE: the matrices of these small models are tiny; with several BLAS
    threads, each call pays for waking (and, on a busy machine, waiting for)
    the others, which measured several times slower than one thread.
    """
    from ..kernels import blas_threads

    return blas_threads(1)


def default_checkpoint_path(config, step):
    """Where an interrupted run without ``save`` writes its checkpoint."""
    return os.path.abspath(f"qkvnp-{config.task}-step{step}.npz")


# ---------------------------------------------------------------- the loop


def checkpoint_layout(saved_config):
    """What a checkpoint of ``saved_config`` holds: its entries' shapes and dtypes, and its last step.

    The ``layout`` that :func:`train` gives
    :func:`qkvnp.training.checkpoint.load_checkpoint`: the configuration is
    resolved (so every size is bounded by :data:`qkvnp.training.config.MAXIMA`)
    before the model and optimizer it describes are built to read their shapes.

    Parameters
    ----------
    saved_config : dict
        A checkpoint's ``meta/config``.

    Returns
    -------
    specs : dict
        ``{"param/<name>" or "optim/<key>": (shape, dtype)}``.
    max_step : int
        The configuration's ``steps``.
    """
    if saved_config.get("task") == "text":
        raise CheckpointError("is a checkpoint of train --task text, not of the kv-recall, "
                              "partner or teacher tasks: resume it with train --task text "
                              "--resume, or continue a prompt with generate --resume")
    config = TrainConfig.from_dict(saved_config).resolved()
    model = build_model(config, 0)
    optimizer = build_optimizer(config, model.params)
    specs = {"param/" + name: (value.shape, value.dtype) for name, value in model.params.items()}
    specs.update({"optim/" + name: (value.shape, value.dtype)
                  for name, value in optimizer.state_dict().items()})
    return specs, config.steps


def _check_resume_config(checkpoint, config):
    """Refuse a checkpoint whose configuration differs in a field that shapes the run."""
    try:
        saved = TrainConfig.from_dict(checkpoint.config).resolved()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{checkpoint.path!r} holds an invalid configuration "
                              f"(meta/config): {exc}") from None
    differences = [
        f"{field.name}: checkpoint {getattr(saved, field.name)!r}, this run "
        f"{getattr(config, field.name)!r}"
        for field in dataclasses.fields(TrainConfig)
        if field.name not in RESUMABLE_CHANGES
        and getattr(saved, field.name) != getattr(config, field.name)
    ]
    if differences:
        raise CheckpointError(
            f"{checkpoint.path!r} was saved by a run with another configuration ("
            + "; ".join(differences) + "); resume with the checkpoint's settings "
            "(only --steps, --eval-every and --eval-size may change)"
        )


def check_resume(checkpoint, config):
    """Refuse a checkpoint that the run of ``config`` cannot continue; change nothing.

    Parameters
    ----------
    checkpoint : Checkpoint
        Read with ``load_checkpoint(path, checkpoint_layout)``, so that its
        entries have its configuration's names, shapes and dtypes.
    config : TrainConfig
        Resolved.

    Raises
    ------
    CheckpointError
        Naming the file and the entry: another configuration (except
        ``steps``, ``eval_every``, ``eval_size``), a step beyond
        ``config.steps``, an optimizer step count other than the
        checkpoint's step, an RNG state that is not PCG64's, generator states
        (``meta/generator_states``) that are not the model's.
    """
    path = checkpoint.path
    _check_resume_config(checkpoint, config)
    if checkpoint.step > config.steps:
        raise CheckpointError(
            f"checkpoint {path!r} is at step {checkpoint.step}, beyond steps={config.steps}: "
            "steps counts the total, pass a larger --steps"
        )
    check_run_state(checkpoint, build_model(config, 0).generators())


def check_run_state(checkpoint, generators):
    """Refuse a checkpoint whose optimizer step or generator states a run cannot continue from.

    The checks every task's resume shares: ``optim/step`` equals ``meta/step``,
    ``meta/rng_state`` is a PCG64 state numpy writes, and
    ``meta/generator_states`` holds a valid state for exactly ``generators``.

    Parameters
    ----------
    checkpoint : Checkpoint
    generators : dict of str to numpy.random.Generator
        The run's Generators besides the batches' (the model's, and the
        text task's ``"sample"``), by name.

    Returns
    -------
    dict
        ``{name: state}``, checked on copies, ready to assign.

    Raises
    ------
    CheckpointError
        Naming the file and the entry.
    """
    path = checkpoint.path
    optimizer_step = checkpoint.optimizer_state.get("step")
    if optimizer_step is None or optimizer_step.shape != () or int(optimizer_step) != checkpoint.step:
        raise CheckpointError(
            f"{path!r}: entry 'optim/step' is {optimizer_step}, but the checkpoint is at "
            f"step {checkpoint.step} (meta/step); the optimizer takes one step per step"
        )
    probe = np.random.Generator(np.random.PCG64())
    try:
        _check_pcg64_state(checkpoint.rng_state)
        probe.bit_generator.state = checkpoint.rng_state
    except (TypeError, ValueError, KeyError, OverflowError) as exc:
        raise CheckpointError(
            f"{path!r}: entry 'meta/rng_state' is not a PCG64 generator state "
            f"({type(exc).__name__}: {exc})"
        ) from None
    return _generator_states(checkpoint, generators)


def _is_int(value, low, high):
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def _check_pcg64_state(state):
    """Refuse a PCG64 state that numpy would not write (``ValueError``); numpy checks less.

    NOTE: numpy takes ``has_uint32`` of 2 or -1 and an even ``inc``, and before
    2.0 a ``state`` of -1 (numpy 1.24 on Python 3.9): a generator it never
    produces, so a checkpoint holding one was not written by a run.
    """
    if not isinstance(state, dict) or set(state) != {"bit_generator", "state", "has_uint32",
                                                     "uinteger"}:
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"expected the keys bit_generator, state, has_uint32, uinteger, "
                         f"got {keys}")
    if state["bit_generator"] != "PCG64":
        raise ValueError(f"bit_generator must be 'PCG64', got {state['bit_generator']!r}")
    words = state["state"]
    if not isinstance(words, dict) or set(words) != {"state", "inc"}:
        raise ValueError(f"state must be a dict with the keys state and inc, got {words!r}")
    for name in ("state", "inc"):
        if not _is_int(words[name], 0, 2 ** 128):
            raise ValueError(f"state[{name!r}] must be an int in [0, 2**128), "
                             f"got {words[name]!r}")
    if words["inc"] % 2 == 0:
        raise ValueError(f"state['inc'] must be odd (numpy's PCG64 increments are), "
                         f"got {words['inc']!r}")
    if not _is_int(state["has_uint32"], 0, 2):
        raise ValueError(f"has_uint32 must be 0 or 1, got {state['has_uint32']!r}")
    if not _is_int(state["uinteger"], 0, 2 ** 32):
        raise ValueError(f"uinteger must be an int in [0, 2**32), got {state['uinteger']!r}")


def _generator_states(checkpoint, generators):
    """The checkpoint's states of the model's ``generators`` (dropout), checked on copies.

    A file without the entry (written before it existed, by a model that drew
    nothing from them) gives ``{}``: the fresh generators are then right.
    """
    saved = checkpoint.generator_states
    unknown = sorted(set(saved) - set(generators))
    missing = sorted(set(generators) - set(saved)) if saved else []
    if unknown or missing:
        raise CheckpointError(f"{checkpoint.path!r}: entry 'meta/generator_states' does not match "
                              f"the model's generators (unexpected {unknown}, missing {missing})")
    states = {}
    for name, state in saved.items():
        probe = np.random.Generator(type(generators[name].bit_generator)())
        try:
            if isinstance(probe.bit_generator, np.random.PCG64):
                _check_pcg64_state(state)
            probe.bit_generator.state = state
        except (TypeError, ValueError, KeyError, OverflowError) as exc:
            raise CheckpointError(f"{checkpoint.path!r}: entry 'meta/generator_states' holds a "
                                  f"state for {name!r} that is not a generator state "
                                  f"({type(exc).__name__}: {exc})") from None
        states[name] = probe.bit_generator.state
    return states


def _restore(checkpoint, config, model, optimizer, data_rng):
    """Load a checkpoint into a fresh model/optimizer/generator, or raise before changing any.

    Returns its history (lists from step 1), which the run extends.
    """
    check_resume(checkpoint, config)
    generators = model.generators()
    states = _generator_states(checkpoint, generators)
    try:
        optimizer.load_state_dict(checkpoint.optimizer_state)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{checkpoint.path!r}: the optimizer entries (optim/) are "
                              f"refused: {exc}") from None
    params = model.params
    for name, value in checkpoint.params.items():
        params[name][...] = value  # in place: the layers share these arrays
    data_rng.bit_generator.state = checkpoint.rng_state
    for name, state in states.items():  # the dropout masks continue where they stopped
        generators[name].bit_generator.state = state
    return checkpoint.history


def save_run(path, model, optimizer, step, data_rng, config, history, generators=None):
    """Write a run's checkpoint atomically; any OSError becomes a :class:`SaveError`.

    ``config``: the run's configuration as a dict; ``generators``: its
    Generators besides ``data_rng``, by name (default ``model.generators()``).
    """
    generators = model.generators() if generators is None else generators
    try:
        save_checkpoint(path, model.params, optimizer.state_dict(), step,
                        data_rng.bit_generator.state, config, history,
                        generator_states={name: generator.bit_generator.state
                                          for name, generator in generators.items()})
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.errno == errno.ENOSPC:
            reason = "the disk is full"
        raise SaveError(f"could not write the checkpoint of step {step} to {path!r}: {reason}; "
                        "the file there is as it was") from None
    return path


def check_save_options(save, save_every, names=("save", "save_every")):
    """The rules of ``save`` and ``save_every`` that every training task shares.

    ``save`` must be writable now (:func:`qkvnp._io.check_writable`);
    ``save_every`` needs ``save`` and is an int >= 1. ``names``: how the
    messages spell the two (the command lines pass ``--save``, ``--save-every``).
    Returns ``(save, save_every)``, ``save`` as a str.

    Raises
    ------
    ValueError, TypeError, OSError
        Naming the option; nothing is written.
    """
    if save_every is not None:
        if save is None:
            raise ValueError(f"{names[1]} needs {names[0]} (the checkpoint to write)")
        save_every = check_int(save_every, names[1], 1)
    if save is not None:
        save = os.fspath(save)
        check_writable(save, names[0])
    return save, save_every


@contextlib.contextmanager
def divergence_guard(step, config):
    """Turn "x contains NaN or inf" from an input check, or "the query projection overflowed",
    into a divergence error: inside a training step, the inputs are the run's own values."""
    try:
        yield
    except ValueError as exc:
        if "NaN or inf" not in str(exc) and "overflowed" not in str(exc):
            raise
        raise FloatingPointError(
            f"training diverged at step {step} ({exc}); lower the learning rate "
            f"(now {config.lr:g} with {config.optimizer})"
        ) from None


def check_finite(model, step, config, loss=0.0):
    """Raise ``FloatingPointError`` if the loss, a parameter or a gradient is not finite."""
    bad = [] if math.isfinite(loss) else ["the loss"]
    bad += [f"parameter {name}" for name, value in model.params.items()
            if not np.isfinite(value).all()]
    bad += [f"the gradient of {name}" for name, value in model.grads.items()
            if not np.isfinite(value).all()]
    if bad:
        raise FloatingPointError(
            f"training diverged at step {step}: {', '.join(bad[:3])} became NaN or inf; "
            f"lower the learning rate (now {config.lr:g} with {config.optimizer})"
        )


def _training_step(model, task, optimizer, config, step, data_rng, heldout_batch):
    """Step ``step`` of :func:`train`: one optimizer step on a fresh batch, and the held-out
    evaluation when it is due. Returns ``(loss, accuracy or None, heldout metrics or None)``."""
    optimizer.lr = scheduled_lr(config, step)
    batch = task.sample(data_rng, config.batch_size)
    with divergence_guard(step, config):
        model.zero_grad()
        out = _forward(model, batch)
        loss, acc, dout = _loss(task, out, batch)
        model.backward(dout)
        check_finite(model, step, config, loss)
        optimizer.step(model.grads)
        evaluated = None
        if step % config.eval_every == 0 or step == config.steps:
            evaluated = evaluate(model, task, heldout_batch)
    return loss, acc, evaluated


def train(config: TrainConfig, *, resume: str | str | os.PathLike[str] | Checkpoint | None = None,
          save: str | str | os.PathLike[str] | None = None, save_every: int | None = None,
          callback: Callable[..., Any] | None = None,
          save_on_interrupt: bool = True) -> TrainResult:
    """Train the model of ``config``; optionally resume from / save to a checkpoint.

    Parameters
    ----------
    config : TrainConfig
    resume : str or os.PathLike or Checkpoint, optional
        Checkpoint to continue from (a path, or what
        ``load_checkpoint(path, checkpoint_layout)`` returned). Its
        configuration must equal ``config`` except for ``steps``,
        ``eval_every`` and ``eval_size``; training runs from its step up to
        ``config.steps``. With the checkpoint's own ``steps``, the run ends
        bitwise identical to one that never stopped; with another, the cosine
        schedule follows the new horizon from the checkpoint's step on.
    save : str or os.PathLike, optional
        Checkpoint written at the end (and on Ctrl-C or SIGTERM), atomically;
        a symlink is written through. Checked before the first step (see
        ``qkvnp._io.check_writable``).
    save_every : int, optional
        Also write ``save`` every ``save_every`` steps, so that a run killed
        without warning (SIGKILL, out of memory, power cut) loses at most that
        many steps. Needs ``save``.
    callback : callable, optional
        Called after every step as ``callback(info)`` with a dict ``step,
        steps, loss, accuracy, lr, heldout`` (``heldout`` is the metrics
        dict on evaluation steps, else None), ``start_step`` and ``seconds``
        (since this session's first step started). The CLI's
        ``qkvnp.training.report.Progress`` is one.
    save_on_interrupt : bool
        Without ``save``, whether an interrupted run writes its checkpoint to
        ``qkvnp.training.loop.default_checkpoint_path`` (default True). The ablation passes
        False: it stops and keeps none of an interrupted run.

    Returns
    -------
    TrainResult

    Raises
    ------
    CheckpointError
        (a ``ValueError``) if ``resume`` is unreadable or belongs to another
        run (configuration, parameter names, shapes or dtypes); nothing is
        trained or written then. :func:`qkvnp.training.load_checkpoint`
        lists what makes a file unreadable.
    FileNotFoundError
        If ``resume`` does not exist, or the directory of ``save`` does not.
    ValueError, PermissionError
        If ``save`` is empty, a directory, a special file, or in a directory
        where no file can be created; nothing is trained then.
    SaveError
        (an ``OSError``) if writing a checkpoint fails (a full disk): the file
        at ``save`` is left as it was, and no temporary file is left behind.
    FloatingPointError
        If the run diverges.

    Examples
    --------
    >>> config = TrainConfig(steps=3, num_keys=8, num_values=8, num_pairs=4, dim=8, eval_size=16)
    >>> result = train(config)
    >>> result.step, sorted(result.heldout)
    (3, ['accuracy', 'loss'])
    """
    from .tasks import make_streams

    config = config.resolved()
    save, save_every = check_save_options(save, save_every)
    if resume is not None and not isinstance(resume, Checkpoint):
        resume = load_checkpoint(resume, checkpoint_layout)
    streams = make_streams(config.seed)
    task = build_task(config, streams.teacher)
    model = build_model(config, streams.init)
    optimizer = build_optimizer(config, model.params)
    heldout_batch = task.sample(streams.heldout, config.eval_size)
    initial = evaluate(model, task, heldout_batch)
    data_rng = streams.data
    step = 0
    history: dict[str, list[float]] = {key: [] for key in HISTORY_FIELDS}
    if resume is not None:
        history = _restore(resume, config, model, optimizer, data_rng)
        step = resume.step
    start_step = step
    heldout = evaluate(model, task, heldout_batch) if step else initial
    checkpoint_path = None
    started = time.perf_counter()
    # NOTE: numpy's overflow warnings say nothing that check_finite and the
    # layers' input checks do not say as one "training diverged" error (and
    # under -W error they would be tracebacks instead of that error)
    with _blas_single_thread(), StopFlag(save is not None or save_on_interrupt) as stop, \
            np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        while step < config.steps and not stop.requested:
            step += 1
            loss, acc, evaluated = _training_step(model, task, optimizer, config, step, data_rng,
                                                  heldout_batch)
            for key, value in (("step", step), ("loss", loss), ("accuracy", acc),
                               ("lr", optimizer.lr)):
                history[key].append(value)
            if evaluated is not None:
                heldout = evaluated
                history["eval_step"].append(step)
                history["eval_loss"].append(heldout["loss"])
                history["eval_accuracy"].append(heldout["accuracy"])
            if save_every is not None and step % save_every == 0 and step < config.steps:
                save_run(save, model, optimizer, step, data_rng, config.to_dict(), history)
            if callback is not None:
                callback({"step": step, "steps": config.steps, "start_step": start_step,
                          "loss": loss, "accuracy": acc, "lr": optimizer.lr,
                          "heldout": evaluated, "seconds": time.perf_counter() - started})
        interrupted = stop.requested and step < config.steps  # a finished run just ends
        seconds = time.perf_counter() - started
        if interrupted:
            heldout = evaluate(model, task, heldout_batch)
            if save is not None:
                checkpoint_path = save
            elif save_on_interrupt:
                checkpoint_path = default_checkpoint_path(config, step)
        elif save is not None:
            checkpoint_path = save
        if checkpoint_path is not None:
            save_run(checkpoint_path, model, optimizer, step, data_rng, config.to_dict(), history)
    return TrainResult(config, model, optimizer, task, step, start_step, history, heldout,
                       initial, seconds, interrupted, checkpoint_path,
                       stop.signal if interrupted else None)
