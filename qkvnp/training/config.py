"""What defines a training run: :class:`TrainConfig`, its defaults and its limits.

Shape key: B batch (or held-out set), P stored key/value pairs, T sequence
length, E embedding, H heads, K key vocabulary, V value vocabulary.

A configuration is checked as a whole by :meth:`TrainConfig.resolved`
before anything is built: every field's type and range, the combinations
(``num_pairs <= num_keys``, ``num_heads`` divides ``embed_dim``), and the
sizes it implies (parameters, the largest batch array) against
:data:`MAXIMA`, so that neither a typo on the command line nor a hostile
checkpoint can make the app allocate gigabytes before it says no.
"""
from __future__ import annotations

import dataclasses
import math

from .._checks import check_int

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any, Mapping

__all__ = [
    "TrainConfig",
    "TASK_DEFAULTS",
    "LOOKUP_TASKS",
    "SGD_LR",
    "RESUMABLE_CHANGES",
    "MAXIMA",
    "parameter_count",
    "largest_batch_array",
]

TASK_DEFAULTS = {
    # task -> defaults that differ between tasks (measured on a 2-core machine)
    "kv-recall": {"steps": 1000, "lr": 5e-3},
    "partner": {"steps": 1000, "lr": 5e-3},
    "teacher": {"steps": 2000, "lr": 2e-2},
}
SGD_LR = {"kv-recall": 0.05, "partner": 0.05, "teacher": 0.5}
# tasks that store key/value pairs and query one key (the same model, the same fields)
LOOKUP_TASKS = ("kv-recall", "partner")
# fields that may differ between a checkpoint and the run resuming it
RESUMABLE_CHANGES = ("steps", "eval_every", "eval_size")

# NOTE: limits far above what this app is for (the defaults train 24,704
# parameters in seconds), low enough that building what they allow fits in
# memory: a float64 model of MAXIMA["parameters"] is 128 MiB (with Adam's two
# buffers 384 MiB), an array of MAXIMA["batch_elements"] is 512 MiB.
MAXIMA = {
    "steps": 10**7,
    "warmup": 10**7,
    "eval_every": 10**7,
    "batch_size": 2**16,
    "eval_size": 10**6,
    "seed": 2**128,
    "num_keys": 2**20,
    "num_values": 2**20,
    "num_pairs": 2**12,
    "dim": 2**12,
    "embed_dim": 2**12,
    "num_heads": 2**12,
    "seq_len": 2**12,
    "parameters": 2**24,  # parameter_count(config)
    "batch_elements": 2**26,  # largest_batch_array(config)
}
_POSITIVE = ("steps", "batch_size", "eval_size", "num_keys", "num_values", "num_pairs", "dim",
             "embed_dim", "num_heads", "seq_len")


@dataclasses.dataclass
class TrainConfig:
    """Everything that defines a training run (saved as JSON in checkpoints).

    ``steps`` and ``lr`` left as None take the task's default
    (``TASK_DEFAULTS``; SGD has its own learning rates), ``eval_every``
    None means ``steps // 10``: :meth:`resolved` fills them in. Every
    parameter is an attribute of the same name.

    Parameters
    ----------
    task : {"kv-recall", "partner", "teacher"}
        The task trained.
    steps : int
        Total optimizer steps of the run (a resumed run continues up to it).
        Also the horizon of the cosine schedule.
    lr : float
        Peak learning rate.
    optimizer : {"adam", "adamw", "sgd"}
        The optimizer of the run.
    momentum : float
        SGD momentum, >= 0 (ignored by Adam).
    weight_decay : float
        >= 0. Default 0.01 for AdamW (decoupled, as ``torch.optim.AdamW``), 0 otherwise.
    schedule : {"cosine", "constant"}
        ``cosine``: linear warm-up over ``warmup`` steps, then cosine decay
        towards 0 at ``steps``.
    warmup : int
        Steps of the linear warm-up of the cosine schedule.
    batch_size : int
        Sequences a step.
    seed : int
        Seed of the data, the initial weights and the dropout masks.
    dtype : {"float64", "float32"}
        Floating dtype of the parameters and the computation (float32 or float64).
    eval_every : int
        Held-out evaluation period, in steps.
    eval_size : int
        Number of held-out sequences.
    num_keys, num_values, num_pairs, dim, variant
        kv-recall and partner tasks and their model (see
        :class:`qkvnp.training.models.KVRecallModel`); partner needs an even
        ``num_keys`` and ``num_pairs >= 2``.
    embed_dim, num_heads, seq_len
        teacher task and student.
    dropout : float
        Dropout on the attention weights while training, in ``[0, 1)``
        (default 0: none); the held-out evaluations run without it.
    """

    task: str = "kv-recall"
    steps: int = None  # type: ignore[assignment]  # None: resolved() fills the default
    lr: float = None  # type: ignore[assignment]  # None: resolved() fills the default
    optimizer: str = "adam"
    momentum: float = 0.9
    weight_decay: float = None  # type: ignore[assignment]  # None: resolved() fills the default
    schedule: str = "cosine"
    warmup: int = 50
    batch_size: int = 64
    seed: int = 0
    dtype: str = "float64"
    eval_every: int = None  # type: ignore[assignment]  # None: resolved() fills the default
    eval_size: int = 2000
    num_keys: int = 64
    num_values: int = 64
    num_pairs: int = 16
    dim: int = 64
    variant: str = "separate"
    embed_dim: int = 16
    num_heads: int = 2
    seq_len: int = 8
    dropout: float = 0.0

    def resolved(self) -> TrainConfig:
        """A copy with defaults filled in and every field checked.

        Raises
        ------
        TypeError
            A field of the wrong type (``"<field> must be an int, ..."``).
        ValueError
            A field out of range or of an unknown choice, a combination that
            cannot be built, or sizes beyond ``MAXIMA``; the message
            starts with the field's name.
        """
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
        for name in _POSITIVE:
            setattr(config, name, check_int(getattr(config, name), name, 1, MAXIMA[name]))
        for name in ("seed", "warmup"):
            setattr(config, name, check_int(getattr(config, name), name, 0, MAXIMA[name]))
        if config.eval_every is None:
            config.eval_every = max(1, config.steps // 10)
        config.eval_every = check_int(config.eval_every, "eval_every", 1, MAXIMA["eval_every"])
        for name in ("lr", "momentum", "weight_decay"):
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"{name} must be a finite number, got {value!r}")
            setattr(config, name, float(value))
        from ..ops.dropout import check_dropout_p

        config.dropout = check_dropout_p(config.dropout, "dropout")
        if config.lr <= 0:
            raise ValueError(f"lr must be > 0, got {config.lr}")
        for name in ("momentum", "weight_decay"):  # what the optimizers accept
            if getattr(config, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(config, name)}")
        # NOTE: the other task's fields are not used; only their types and ranges are checked
        if config.task in LOOKUP_TASKS and config.num_pairs > config.num_keys:
            raise ValueError(f"num_pairs must be <= num_keys={config.num_keys} (keys of a "
                             f"sequence are distinct), got num_pairs={config.num_pairs}")
        if config.task == "partner" and config.num_keys % 2:
            raise ValueError(f"num_keys must be even for partner (every key needs a partner), "
                             f"got num_keys={config.num_keys}")
        if config.task == "partner" and config.num_pairs < 2:
            raise ValueError(f"num_pairs must be >= 2 for partner (the query key and its "
                             f"partner are both stored), got num_pairs={config.num_pairs}")
        if config.task == "teacher" and config.embed_dim % config.num_heads:
            raise ValueError(f"num_heads must divide embed_dim={config.embed_dim}, got "
                             f"num_heads={config.num_heads}")
        for name, size in (("parameters", parameter_count(config)),
                           ("batch_elements", largest_batch_array(config))):
            if size > MAXIMA[name]:
                raise ValueError(_too_big(config, name, size))
        return config

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """Rebuild from :meth:`to_dict`; unknown keys raise ``ValueError``."""
        if not isinstance(data, dict):
            raise TypeError(f"a configuration must be a dict, got {type(data).__name__}")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known, key=str)
        if unknown:
            raise ValueError(f"unknown configuration keys {unknown}; expected a subset of {sorted(known)}")
        return cls(**data)


def _choice(value, name, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def parameter_count(config):
    """Number of scalar parameters of ``config``'s model (an upper bound: all three projections).

    kv-recall and partner: embeddings ``(K + V) E``, the query marker ``E``, up to three
    ``E x E`` projections, the readout ``E V + V``. teacher: the student's
    ``4 E^2 + 4 E`` (the teacher is as large).
    """
    if config.task in LOOKUP_TASKS:
        E, K, V = config.dim, config.num_keys, config.num_values
        return (K + V) * E + E + 3 * E * E + E * V + V
    E = config.embed_dim
    return 4 * E * E + 4 * E


def largest_batch_array(config):
    """Elements of the largest array one training or held-out batch makes.

    kv-recall and partner: the key permutation draw ``(B, K)``, the items ``(B, P, E)``
    and the logits ``(B, V)``; teacher: the weights ``(B, H, T, T)`` and the
    activations ``(B, T, E)``; with ``B`` the larger of ``batch_size`` and
    ``eval_size``.
    """
    B = max(config.batch_size, config.eval_size)
    if config.task in LOOKUP_TASKS:
        return B * max(config.num_keys, config.num_pairs * config.dim, config.num_values)
    T = config.seq_len
    return B * T * max(config.num_heads * T, config.embed_dim)


def _too_big(config, name, size):
    if name == "parameters":
        fields = ("dim", "num_keys", "num_values") if config.task in LOOKUP_TASKS else ("embed_dim",)
        what = f"the model would have {size:,} parameters"
    else:
        fields = (("batch_size", "eval_size", "num_keys", "num_pairs", "dim", "num_values")
                  if config.task in LOOKUP_TASKS
                  else ("batch_size", "eval_size", "seq_len", "num_heads", "embed_dim"))
        what = f"one batch would need an array of {size:,} elements"
    settings = ", ".join(f"{field}={getattr(config, field)}" for field in fields)
    return (f"{fields[0]} too large: {what} (> {MAXIMA[name]:,}) with {settings}; "
            "this app trains small models")
