"""The training app: tasks, models, the training loop, its report, checkpoints, ablation.

Built on the library (layers, losses, optimizers); nothing in the library
imports it. ``python -m qkvnp train`` runs :func:`qkvnp.training.command.run`,
``python -m qkvnp ablation`` runs :func:`qkvnp.training.ablation.run`.

========================  =====================================================
:mod:`~.tasks`            kv-recall, partner and teacher tasks, the seeded random streams
:mod:`~.models`           ``KVRecallModel`` (and its Q/K/V variants), ``AttentionRegressor``
:mod:`~.config`           ``TrainConfig``: defaults, checks, size limits
:mod:`~.loop`             ``train``: the loop, resume, Ctrl-C/SIGTERM, periodic saves
:mod:`~.command`          the ``train`` command: every option checked before training
:mod:`~.report`           progress line, summary, attention example, plot
:mod:`~.checkpoint`       ``.npz`` checkpoints, written atomically, headers checked before data
:mod:`~.ablation`         why separate Q, K and V: the variants side by side on two tasks
:mod:`~.ablation_report`  the ablation's tables, takeaway, JSON summary and plot
========================  =====================================================
"""
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .loop import TrainConfig, TrainResult, train
from .models import VARIANTS, AttentionRegressor, KVRecallModel
from .tasks import TASKS, KVRecallTask, PartnerTask, TeacherTask, make_streams

__all__ = [
    "TrainConfig",
    "TrainResult",
    "train",
    "KVRecallModel",
    "AttentionRegressor",
    "VARIANTS",
    "KVRecallTask",
    "PartnerTask",
    "TeacherTask",
    "TASKS",
    "make_streams",
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
]
