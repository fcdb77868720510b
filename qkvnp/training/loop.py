"""Train attention projections by gradient descent, with hand-derived gradients only.

Shape key: B batch, P stored key/value pairs, T sequence length, E embedding,
V value vocabulary.

``python -m qkvnp train`` trains the ``kv-recall`` model (the default task)
or the ``teacher`` task's student, prints a live progress line and a final
summary, and can save, resume and plot a run::

    python -m qkvnp train                              # kv-recall, ~1000 steps
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

Ctrl-C stops the run at the end of the current step, saves a checkpoint
(to ``--save``, or to a default path that is printed) and exits with 130;
a second Ctrl-C aborts at once without saving.
"""
import contextlib
import dataclasses
import math
import os
import signal
import sys
import threading
import time
from collections import namedtuple

import numpy as np

from .._checks import check_int
from .checkpoint import (HISTORY_FIELDS, CheckpointError, check_params_match, load_checkpoint,
                         save_checkpoint)

__all__ = [
    "TrainConfig",
    "TrainResult",
    "train",
    "build_model",
    "build_task",
    "build_optimizer",
    "scheduled_lr",
    "evaluate",
    "add_arguments",
    "run",
]

TASK_DEFAULTS = {
    # task -> defaults that differ between tasks (measured on a 2-core machine)
    "kv-recall": {"steps": 1000, "lr": 5e-3},
    "teacher": {"steps": 2000, "lr": 2e-2},
}
SGD_LR = {"kv-recall": 0.05, "teacher": 0.5}
# fields that may differ between a checkpoint and the run resuming it
RESUMABLE_CHANGES = ("steps", "eval_every", "eval_size")


@dataclasses.dataclass
class TrainConfig:
    """Everything that defines a training run (saved as JSON in checkpoints).

    ``steps`` and ``lr`` left as None take the task's default
    (:data:`TASK_DEFAULTS`; SGD has its own learning rates), ``eval_every``
    None means ``steps // 10``: :meth:`resolved` fills them in.

    Attributes
    ----------
    task : {"kv-recall", "teacher"}
    steps : int
        Total optimizer steps of the run (a resumed run continues up to it).
    lr : float
        Peak learning rate.
    optimizer : {"adam", "adamw", "sgd"}
    momentum : float
        SGD momentum (ignored by Adam).
    weight_decay : float
        Default 0.01 for AdamW (decoupled, as ``torch.optim.AdamW``), 0 otherwise.
    schedule : {"cosine", "constant"}
        ``cosine``: linear warm-up over ``warmup`` steps, then cosine decay
        towards 0 at ``steps``.
    warmup : int
    batch_size : int
    seed : int
    dtype : {"float64", "float32"}
    eval_every : int
        Held-out evaluation period, in steps.
    eval_size : int
        Number of held-out sequences.
    num_keys, num_values, num_pairs, dim, variant
        kv-recall task and model (see :class:`qkvnp.training.models.KVRecallModel`).
    embed_dim, num_heads, seq_len
        teacher task and student.
    """

    task: str = "kv-recall"
    steps: int = None
    lr: float = None
    optimizer: str = "adam"
    momentum: float = 0.9
    weight_decay: float = None
    schedule: str = "cosine"
    warmup: int = 50
    batch_size: int = 64
    seed: int = 0
    dtype: str = "float64"
    eval_every: int = None
    eval_size: int = 2000
    num_keys: int = 64
    num_values: int = 64
    num_pairs: int = 16
    dim: int = 64
    variant: str = "separate"
    embed_dim: int = 16
    num_heads: int = 2
    seq_len: int = 8

    def resolved(self):
        """A copy with defaults filled in and every field checked."""
        config = dataclasses.replace(self)
        _choice(config.task, "task", tuple(TASK_DEFAULTS))
        _choice(config.optimizer, "optimizer", ("adam", "adamw", "sgd"))
        _choice(config.schedule, "schedule", ("cosine", "constant"))
        _choice(config.dtype, "dtype", ("float64", "float32"))
        from .models import VARIANTS

        _choice(config.variant, "variant", tuple(VARIANTS))
        defaults = TASK_DEFAULTS[config.task]
        if config.steps is None:
            config.steps = defaults["steps"]
        if config.weight_decay is None:
            config.weight_decay = 0.01 if config.optimizer == "adamw" else 0.0
        if config.lr is None:
            config.lr = SGD_LR[config.task] if config.optimizer == "sgd" else defaults["lr"]
        for name in ("steps", "batch_size", "eval_size", "num_keys", "num_values", "num_pairs",
                     "dim", "embed_dim", "num_heads", "seq_len"):
            check_int(getattr(config, name), name, 1)
        for name in ("seed", "warmup"):
            check_int(getattr(config, name), name, 0)
        if config.eval_every is None:
            config.eval_every = max(1, config.steps // 10)
        check_int(config.eval_every, "eval_every", 1)
        for name in ("lr", "momentum", "weight_decay"):
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"{name} must be a finite number, got {value!r}")
            setattr(config, name, float(value))
        if config.lr <= 0:
            raise ValueError(f"lr must be > 0, got {config.lr}")
        return config

    def to_dict(self):
        """Plain dict (JSON-serialisable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data):
        """Rebuild from :meth:`to_dict`; unknown keys raise ``ValueError``."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown configuration keys {unknown}; expected a subset of {sorted(known)}")
        return cls(**data)


def _choice(value, name, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


TrainResult = namedtuple(
    "TrainResult",
    "config model optimizer task step start_step history heldout initial_heldout seconds "
    "interrupted checkpoint",
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
``interrupted`` (True after Ctrl-C), ``checkpoint`` (path written, or None).
"""


# ---------------------------------------------------------------- building blocks


def build_task(config, rng):
    """The task of ``config`` (``rng``: the teacher's weights, unused by kv-recall)."""
    from .tasks import KVRecallTask, TeacherTask

    if config.task == "kv-recall":
        return KVRecallTask(config.num_keys, config.num_values, config.num_pairs)
    return TeacherTask(config.embed_dim, config.num_heads, config.seq_len, rng=rng,
                       dtype=np.dtype(config.dtype))


def build_model(config, rng):
    """The model of ``config``, initialised from ``rng``."""
    from .models import AttentionRegressor, KVRecallModel

    if config.task == "kv-recall":
        return KVRecallModel(config.num_keys, config.num_values, config.dim,
                             variant=config.variant, rng=rng, dtype=np.dtype(config.dtype))
    return AttentionRegressor(config.embed_dim, config.num_heads, rng=rng,
                              dtype=np.dtype(config.dtype))


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

    ``accuracy`` is None for the (regression) teacher task.
    """
    out = _forward(model, batch)
    loss, acc, _ = _loss(task, out, batch)
    return {"loss": loss, "accuracy": acc}


# ---------------------------------------------------------------- Ctrl-C


class _StopFlag:
    """SIGINT sets a flag checked between steps; a second SIGINT raises at once.

    Only installed in the main thread (signal handlers cannot be set elsewhere).
    """

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        sys.stderr.write("\nCtrl-C: stopping after this step and saving a checkpoint "
                         "(Ctrl-C again aborts without saving)\n")
        sys.stderr.flush()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


def _blas_single_thread():
    """Pin BLAS to one thread during training (when numpy's OpenBLAS can be found).

    NOTE: the matrices of these small models are tiny; with several BLAS
    threads, each call pays for waking (and, on a busy machine, waiting for)
    the others: measured 6x slower on a loaded 2-core machine.
    """
    from ..kernels import blas_threads

    return blas_threads(1)


def default_checkpoint_path(config, step):
    """Where an interrupted run without ``save`` writes its checkpoint."""
    return os.path.abspath(f"qkvnp-{config.task}-step{step}.npz")


# ---------------------------------------------------------------- the loop


def _check_resume_config(saved, config, path):
    """Refuse a checkpoint whose configuration differs in a field that shapes the run."""
    try:
        saved = TrainConfig.from_dict(saved).resolved()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path!r} holds an invalid configuration: {exc}") from None
    differences = [
        f"{field.name}: checkpoint {getattr(saved, field.name)!r}, this run "
        f"{getattr(config, field.name)!r}"
        for field in dataclasses.fields(TrainConfig)
        if field.name not in RESUMABLE_CHANGES
        and getattr(saved, field.name) != getattr(config, field.name)
    ]
    if differences:
        raise CheckpointError(
            f"{path!r} was saved by a run with another configuration ("
            + "; ".join(differences) + "); resume with the checkpoint's settings "
            "(only --steps, --eval-every and --eval-size may change)"
        )


def _restore(checkpoint, path, config, model, optimizer, data_rng):
    """Load a checkpoint into a fresh model/optimizer/generator, or raise before changing any.

    Returns the checkpoint's history (lists from step 1), which the run extends.
    """
    _check_resume_config(checkpoint.config, config, path)
    params = model.params
    check_params_match(checkpoint.params, params, "parameter", f"checkpoint {path!r}")
    check_params_match(checkpoint.optimizer_state, optimizer.state_dict(), "optimizer entry",
                       f"checkpoint {path!r}")
    if checkpoint.step > config.steps:
        raise CheckpointError(
            f"checkpoint {path!r} is at step {checkpoint.step}, beyond steps={config.steps}: "
            "steps counts the total, pass a larger --steps"
        )
    probe = np.random.Generator(np.random.PCG64())
    try:
        probe.bit_generator.state = checkpoint.rng_state
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"checkpoint {path!r}: meta/rng_state is not a PCG64 generator state ({exc})"
        ) from None
    for name, value in checkpoint.params.items():
        params[name][...] = value  # in place: the layers share these arrays
    optimizer.load_state_dict(checkpoint.optimizer_state)
    data_rng.bit_generator.state = checkpoint.rng_state
    return checkpoint.history


@contextlib.contextmanager
def _divergence_guard(step, config):
    """Turn "x contains NaN or inf" from an input check into a divergence error."""
    try:
        yield
    except ValueError as exc:
        if "NaN or inf" not in str(exc):
            raise
        raise FloatingPointError(
            f"training diverged at step {step} ({exc}); lower the learning rate "
            f"(now {config.lr:g} with {config.optimizer})"
        ) from None


def _check_finite(model, step, config, loss=0.0):
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


def train(config, *, resume=None, save=None, callback=None):
    """Train the model of ``config``; optionally resume from / save to a checkpoint.

    Parameters
    ----------
    config : TrainConfig
    resume : str or os.PathLike, optional
        Checkpoint to continue from. Its configuration must equal ``config``
        except for ``steps``, ``eval_every`` and ``eval_size``; training runs
        from its step up to ``config.steps``.
    save : str or os.PathLike, optional
        Checkpoint written at the end (and on Ctrl-C).
    callback : callable, optional
        Called after every step as ``callback(info)`` with a dict ``step,
        steps, loss, accuracy, lr, heldout`` (``heldout`` is the metrics
        dict on evaluation steps, else None) and ``start_step``. The CLI's
        :class:`qkvnp.training.report.Progress` is one.

    Returns
    -------
    TrainResult

    Raises
    ------
    CheckpointError
        (a ``ValueError``) if ``resume`` is unreadable or belongs to another
        run (configuration, parameter names, shapes or dtypes); nothing is
        trained or written then. :func:`qkvnp.training.checkpoint.load_checkpoint`
        lists what makes a file unreadable.
    FileNotFoundError
        If ``resume`` does not exist, or the directory of ``save`` does not.

    Examples
    --------
    >>> config = TrainConfig(steps=3, num_keys=8, num_values=8, num_pairs=4, dim=8, eval_size=16)
    >>> result = train(config)
    >>> result.step, sorted(result.heldout)
    (3, ['accuracy', 'loss'])
    """
    from .tasks import make_streams

    config = config.resolved()
    if save is not None:
        save = os.fspath(save)
        directory = os.path.dirname(os.path.abspath(save))
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"save: directory {directory!r} does not exist")
    streams = make_streams(config.seed)
    task = build_task(config, streams.teacher)
    model = build_model(config, streams.init)
    optimizer = build_optimizer(config, model.params)
    heldout_batch = task.sample(streams.heldout, config.eval_size)
    initial = evaluate(model, task, heldout_batch)
    data_rng = streams.data
    step = 0
    history = {key: [] for key in HISTORY_FIELDS}
    if resume is not None:
        resume = os.fspath(resume)
        checkpoint = load_checkpoint(resume)
        history = _restore(checkpoint, resume, config, model, optimizer, data_rng)
        step = checkpoint.step
    start_step = step
    heldout = evaluate(model, task, heldout_batch) if step else initial
    interrupted = False
    checkpoint_path = None
    started = time.perf_counter()
    with _blas_single_thread(), _StopFlag() as stop:
        while step < config.steps and not stop.requested:
            step += 1
            optimizer.lr = scheduled_lr(config, step)
            batch = task.sample(data_rng, config.batch_size)
            with _divergence_guard(step, config):
                model.zero_grad()
                out = _forward(model, batch)
                loss, acc, dout = _loss(task, out, batch)
                model.backward(dout)
                _check_finite(model, step, config, loss)
                optimizer.step(model.grads)
                evaluated = None
                if step % config.eval_every == 0 or step == config.steps:
                    heldout = evaluated = evaluate(model, task, heldout_batch)
            for key, value in (("step", step), ("loss", loss), ("accuracy", acc),
                               ("lr", optimizer.lr)):
                history[key].append(value)
            if evaluated is not None:
                history["eval_step"].append(step)
                history["eval_loss"].append(heldout["loss"])
                history["eval_accuracy"].append(heldout["accuracy"])
            if callback is not None:
                callback({"step": step, "steps": config.steps, "start_step": start_step,
                          "loss": loss, "accuracy": acc, "lr": optimizer.lr,
                          "heldout": evaluated})
        interrupted = stop.requested and step < config.steps  # a finished run just ends
        seconds = time.perf_counter() - started
        if interrupted:
            heldout = evaluate(model, task, heldout_batch)
            checkpoint_path = save if save is not None else default_checkpoint_path(config, step)
        elif save is not None:
            checkpoint_path = save
        if checkpoint_path is not None:
            save_checkpoint(checkpoint_path, model.params, optimizer.state_dict(), step,
                            data_rng.bit_generator.state, config.to_dict(), history)
    return TrainResult(config, model, optimizer, task, step, start_step, history, heldout,
                       initial, seconds, interrupted, checkpoint_path)


# ---------------------------------------------------------------- command line


def add_arguments(parser):
    """Add the ``train`` options to an ``argparse`` parser."""
    from .models import VARIANTS

    parser.add_argument("--task", choices=tuple(TASK_DEFAULTS), default=None,
                        help="kv-recall (default): recall the value stored under a key; "
                             "teacher: a student attention layer fits a random teacher")
    parser.add_argument("--steps", type=int, default=None, metavar="N",
                        help="total optimizer steps, counting those of a resumed checkpoint "
                             "(default: kv-recall 1000, teacher 2000)")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate (default: kv-recall 5e-3, teacher 2e-2; "
                             "sgd: kv-recall 0.05, teacher 0.5)")
    parser.add_argument("--optimizer", choices=("adam", "adamw", "sgd"), default=None,
                        help="default adam; sgd uses --momentum")
    parser.add_argument("--momentum", type=float, default=None, help="SGD momentum (default 0.9)")
    parser.add_argument("--weight-decay", type=float, default=None, help="default 0.01 with adamw, else 0")
    parser.add_argument("--schedule", choices=("cosine", "constant"), default=None,
                        help="learning-rate schedule (default cosine, with --warmup steps of "
                             "linear warm-up)")
    parser.add_argument("--warmup", type=int, default=None, metavar="N", help="default 50")
    parser.add_argument("--batch-size", type=int, default=None, metavar="B", help="default 64")
    parser.add_argument("--seed", type=int, default=None, help="default 0")
    parser.add_argument("--dtype", choices=("float64", "float32"), default=None,
                        help="default float64")
    parser.add_argument("--eval-every", type=int, default=None, metavar="N",
                        help="held-out evaluation period (default steps/10)")
    parser.add_argument("--eval-size", type=int, default=None, metavar="N",
                        help="held-out sequences (default 2000)")
    kv = parser.add_argument_group("kv-recall")
    kv.add_argument("--num-keys", type=int, default=None, help="key vocabulary (default 64)")
    kv.add_argument("--num-values", type=int, default=None, help="value vocabulary (default 64)")
    kv.add_argument("--num-pairs", type=int, default=None, help="pairs per sequence (default 16)")
    kv.add_argument("--dim", type=int, default=None, help="model width (default 64)")
    kv.add_argument("--variant", choices=tuple(VARIANTS), default=None,
                    help="Q/K/V projections: separate (default), tied_qk, no_value, shared")
    teacher = parser.add_argument_group("teacher")
    teacher.add_argument("--embed-dim", type=int, default=None, help="default 16")
    teacher.add_argument("--num-heads", type=int, default=None, help="default 2")
    teacher.add_argument("--seq-len", type=int, default=None, help="default 8")
    files = parser.add_argument_group("files")
    files.add_argument("--save", metavar="CKPT.npz", default=None,
                       help="write a checkpoint at the end (and on Ctrl-C)")
    files.add_argument("--resume", metavar="CKPT.npz", default=None,
                       help="continue a saved run up to --steps (its settings are reused)")
    files.add_argument("--plot", metavar="OUT.png", default=None,
                       help="save the loss curve and a held-out attention heat map "
                            "(needs pip install 'qkvnp[plot]')")
    parser.add_argument("--quiet", action="store_true", help="no progress lines, summary only")


_CONFIG_OPTIONS = [field.name for field in dataclasses.fields(TrainConfig)]


def config_from_args(args, base=None):
    """A :class:`TrainConfig` from parsed options laid over ``base`` (a dict)."""
    values = dict(base or {})
    for name in _CONFIG_OPTIONS:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    return TrainConfig.from_dict(values)


def run(args):
    """Run ``python -m qkvnp train`` with the parsed ``args``; return the exit code."""
    from .tasks import make_streams
    from .report import Progress, describe, plot_run, summary

    base = None
    if args.resume is not None:
        try:
            base = load_checkpoint(args.resume).config
        except (FileNotFoundError, CheckpointError) as exc:
            print(f"error: --resume: {exc}; nothing was trained or written", file=sys.stderr)
            return 2
    try:
        config = config_from_args(args, base).resolved()
    except (TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    progress = None if args.quiet else Progress()
    print(describe(config, build_model(config, make_streams(config.seed).init)), flush=True)
    try:
        result = train(config, resume=args.resume, save=args.save, callback=progress)
    except KeyboardInterrupt:
        print("aborted by a second Ctrl-C (or before training started): nothing was saved",
              file=sys.stderr)
        return 130
    except (FileNotFoundError, CheckpointError) as exc:
        print(f"error: {exc}; nothing was trained or written", file=sys.stderr)
        return 2
    except FloatingPointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if progress is not None:
            progress.close()
    for line in summary(result):
        print(line)
    if result.interrupted:
        print(f"interrupted: resume with  python -m qkvnp train --resume {result.checkpoint}"
              + (f" --save {args.save}" if args.save else ""))
        return 130
    if args.plot is not None:
        plot_run(result, args.plot)
    return 0
