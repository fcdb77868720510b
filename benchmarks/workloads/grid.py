"""What the benchmark runs: the grid of shapes, the workloads' names, their FLOPs, the plan.

Shape key: B batch, L sequence length (queries and keys alike), E embedding,
H heads, D = E // H head dim.

The grid: the users' sizes (:data:`USER_CONFIGS`, from the six-token
sentence's (1, 6, 3, 1) to (32, 64, 128, 8)) and four large ones
(:data:`LARGE_CONFIGS`, L = 128 to 4096), float32 and float64, each without a
mask and causal. :func:`plan_cases` turns configurations, dtypes and masks
into the cases of a run: those with L <= :data:`PROCESS_MAX_LENGTH` time the
layer's default path against PyTorch's layer, each library in a process of
its own (:mod:`harness.workers`); the longer ones run every workload and
implementation in one process (:mod:`harness.timing`).

FLOPs
-----
Matmul FLOPs only, 2 per multiply-add; softmax, masking, bias adds and
copies are not counted, and no causal mask is used.

* layer forward: ``8*B*L*E*E`` for the four projections (Q, K, V and the
  output, each ``(B*L, E) @ (E, E)``) plus ``4*B*L*L*E`` for attention;
* core forward: ``4*B*L*L*E`` = ``2 * 2*B*H*L*L*D`` (``Q K^T`` and ``P V``);
* forward+backward = 3 x forward: the backward of each matmul is two matmuls
  of the same size (one per input).

These are the nominal FLOPs of the dense algorithm: the tiled path's
recomputation of ``Q K^T`` in its backward is not counted (as FlashAttention
papers report it). Achieved GFLOP/s = counted FLOPs / median time; "% peak"
divides it by the GEMM peak measured in the same run (:mod:`harness.machine`).

Examples
--------
>>> layer_flops(Config(1, 2, 4, 2))      # 8*1*2*4*4 + 4*1*2*2*4
320
>>> core_flops(Config(1, 2, 4, 2), backward=True)   # 3 * 4*1*2*2*4
192
>>> [tuple(c) for c in up_to_length(QUICK_CONFIGS, 64)][-1]
(32, 64, 128, 8)
"""
from collections import namedtuple

import numpy as np

from qkvnp.kernels import IMPLS, PATH_TOLERANCES

__all__ = [
    "Config",
    "USER_CONFIGS",
    "LARGE_CONFIGS",
    "DEFAULT_CONFIGS",
    "QUICK_CONFIGS",
    "OFF_GRID_CONFIGS",
    "PROCESS_MAX_LENGTH",
    "PROTOCOLS",
    "MASKS",
    "KINDS",
    "MODES",
    "MODE_LABELS",
    "IMPLEMENTATIONS",
    "KIND_IMPLEMENTATIONS",
    "ORACLE",
    "FLOPS",
    "layer_flops",
    "core_flops",
    "check_config",
    "check_dtype",
    "up_to_length",
    "Case",
    "plan_cases",
]


Config = namedtuple("Config", "batch length embed heads")
Config.__doc__ = "One benchmark configuration (B, L, E, H)."

#: The sizes qkvnp's users work at: the six-token sentence "Your journey
#: starts with one step" (E = 3), learners' experiments, the teacher task's
#: (64, 8, 16, 2).
USER_CONFIGS = (
    Config(1, 6, 3, 1),
    Config(8, 16, 32, 4),
    Config(64, 8, 16, 2),
    Config(16, 32, 64, 4),
    Config(64, 33, 64, 1),
    Config(32, 64, 128, 8),
)
LARGE_CONFIGS = (
    Config(8, 128, 256, 8),
    Config(4, 512, 512, 8),
    Config(1, 2048, 512, 8),
    Config(1, 4096, 256, 4),
)
DEFAULT_CONFIGS = USER_CONFIGS + LARGE_CONFIGS
QUICK_CONFIGS = USER_CONFIGS + (Config(8, 128, 256, 8), Config(4, 512, 512, 8))
#: ``--off-grid``: sizes users bring that the grid does not hold. BERT-base's
#: attention (E = 768, 12 heads) on one short sentence, one 128-token sentence
#: and a batch of 8; GPT-2 small's as the book pretrains it (2 x 256 tokens)
#: and at its full context; lengths that are not powers of two.
OFF_GRID_CONFIGS = (
    Config(1, 16, 768, 12),
    Config(4, 100, 64, 4),
    Config(1, 128, 768, 12),
    Config(8, 128, 768, 12),
    Config(32, 200, 64, 4),
    Config(2, 256, 768, 12),
    Config(1, 1000, 64, 1),
    Config(1, 1024, 768, 12),
)
#: Configurations up to this L are timed with one library per process
#: (:mod:`harness.workers`); longer ones in one process, with pauses (:mod:`harness.timing`).
PROCESS_MAX_LENGTH = 128
PROTOCOLS = ("processes", "same process")
MASKS = ("none", "causal")

KINDS = ("layer", "core")
MODES = ("fwd", "fwd_bwd")
MODE_LABELS = {"fwd": "fwd", "fwd_bwd": "fwd+bwd"}
# the layers' impl names (qkvnp.kernels.IMPLS), the three paths first and
# "auto", the layers' default dispatch (fast or tiled), after them; then PyTorch
IMPLEMENTATIONS = tuple(sorted(IMPLS, key=lambda impl: impl == "auto")) + ("torch",)
# the core has no dispatch
KIND_IMPLEMENTATIONS = {"layer": IMPLEMENTATIONS,
                        "core": tuple(i for i in IMPLEMENTATIONS if i != "auto")}
ORACLE = "reference"


# ---------------------------------------------------------------- FLOPs


def layer_flops(config, backward=False):
    """Matmul FLOPs of multi-head self-attention, projections included.

    Forward: ``8*B*L*E*E + 4*B*L*L*E``; with ``backward=True``, 3 x that.

    Parameters
    ----------
    config : Config
    backward : bool
        Count forward+backward instead of the forward alone.

    Returns
    -------
    int
    """
    B, L, E, _ = config
    forward = 4 * 2 * B * L * E * E + 4 * B * L * L * E
    return 3 * forward if backward else forward


def core_flops(config, backward=False):
    """Matmul FLOPs of the attention core: ``4*B*L*L*E`` forward, 3 x with backward.

    ``Q K^T`` and ``P V`` each cost ``2*L*L*D`` per (batch, head) pair, and
    ``H*D = E``.
    """
    B, L, E, _ = config
    forward = 4 * B * L * L * E
    return 3 * forward if backward else forward


FLOPS = {"layer": layer_flops, "core": core_flops}


# ---------------------------------------------------------------- the plan


def check_config(config, name="config"):
    """``config`` as a :class:`Config`.

    ValueError naming ``name`` unless B, L, E, H are positive integers and H divides E.
    """
    try:
        config = Config(*(int(n) for n in config))
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be four integers (B, L, E, H), got {config!r}") from None
    if min(config) < 1:
        raise ValueError(f"{name} must hold positive integers (B, L, E, H), got {tuple(config)}")
    if config.embed % config.heads:
        raise ValueError(
            f"{name} must have E divisible by H, got E={config.embed} and H={config.heads}"
        )
    return config


def check_dtype(dtype):
    """``dtype`` as a numpy dtype; ValueError unless float32 or float64."""
    dtype = np.dtype(dtype)
    if dtype not in PATH_TOLERANCES:
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    return dtype


def up_to_length(configs, max_length):
    """The configurations of ``configs`` with L <= ``max_length``, in their order.

    ``--max-length 512`` keeps the grid's small and medium shapes (the
    users' sizes, (8, 128, 256, 8) and (4, 512, 512, 8)); ``--max-length 128``
    those timed one library per process.
    """
    return [config for config in (check_config(c) for c in configs)
            if config.length <= max_length]


Case = namedtuple("Case", "protocol kind config dtype mask impls")
Case.__doc__ = "One workload to cross-check and time: protocol, kind, Config, dtype, mask, impls."


def plan_cases(configs, dtypes, masks=MASKS, kinds=None, impls=None, quick=False):
    """The cases of a run, in the order they run: one-process-per-library ones first.

    Parameters
    ----------
    configs, dtypes, masks : sequences
    kinds, impls : sequence, optional
        Workloads and implementations; each protocol has its own defaults.
    quick : bool
        The reduced defaults of ``--quick``.

    Returns
    -------
    list of Case

    Notes
    -----
    Defaults: configurations with L <= :data:`PROCESS_MAX_LENGTH` time the
    layer's default path (``auto``; the core's ``fast``) against PyTorch,
    each in a process of its own. Longer ones run in the harness's process:
    without a mask every workload and implementation (the reference
    path untimed with ``quick``), causal the layer without the reference
    path; with ``quick`` only ``auto`` and PyTorch's layer.
    """
    cases = [[], []]
    for config in (check_config(c) for c in configs):
        for dtype in (check_dtype(d) for d in dtypes):
            for mask in masks:
                if config.length <= PROCESS_MAX_LENGTH:
                    protocol, case_kinds, case_impls = "processes", ("layer",), None
                elif quick:
                    protocol, case_kinds, case_impls = "same process", ("layer",), ("auto", "torch")
                elif mask == "none":
                    protocol, case_kinds, case_impls = "same process", KINDS, IMPLEMENTATIONS
                else:
                    protocol, case_kinds = "same process", ("layer",)
                    case_impls = tuple(i for i in IMPLEMENTATIONS if i != ORACLE)
                for kind in kinds or case_kinds:
                    # the layer's default path, or the core's fast path (it has no dispatch)
                    kind_impls = case_impls or ("auto" if kind == "layer" else "fast", "torch")
                    cases[protocol == "same process"].append(
                        Case(protocol, kind, config, dtype, mask, tuple(impls or kind_impls)))
    return cases[0] + cases[1]
