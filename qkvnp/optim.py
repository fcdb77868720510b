"""Optimizers that update a model's ``params`` dict in place from its ``grads``.

Shape key: none of their own; each state buffer has its parameter's shape and dtype.

Each optimizer follows the algorithm documented for its ``torch.optim``
namesake (``maximize=False``, ``amsgrad=False``) in the same operation
order, so float64 trajectories agree with PyTorch's to rounding. The update
equations are written one per line, each with its formula in a comment.

State is keyed by parameter name and exported *flat*: ``state_dict()``
returns ``{"step": 0-d int64, "<buffer>/<param name>": ndarray, ...}``,
ready for ``np.savez`` and ``np.load(..., allow_pickle=False)``.
Hyperparameters (``lr``, ``betas``, ...) are configuration, not state: they
are not in the state dict, and the caller restores them.
"""
from __future__ import annotations

import math
import numbers
from collections import namedtuple

import numpy as np

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Mapping
    from ._typing import Array, ArrayLike, FloatArray


__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "clip_grad_norm"]


def _real(value, name):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _at_least(value, name, low):
    value = _real(value, name)
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _positive(value, name):
    value = _real(value, name)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def _unit_interval(value, name):
    """A value in ``[0, 1)``, as Adam's betas."""
    value = _real(value, name)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return value


class Optimizer:
    """Base class: holds the model's ``params`` dict and per-name state.

    Parameters
    ----------
    params : dict of str to ndarray
        The model's parameters (e.g. ``layer.params``). The dict itself is
        kept, and its arrays are updated **in place**: they keep their
        identity, so a layer sees the new values without any copy-back.
    lr : float
        Learning rate, > 0. A public attribute: a schedule may assign it
        between steps (the new value is validated).

    Attributes
    ----------
    lr : float
    step_count : int
        Number of ``step`` calls so far (``"step"`` in the state dict).
    state : dict of str to ndarray
        Flat state, keys ``"<buffer>/<param name>"``.

    Notes
    -----
    Subclasses list their buffer names in ``_buffers`` and implement
    ``_update(name, param, grad)``.
    """

    _buffers: tuple[str, ...] = ()

    def __init__(self, params: dict[str, FloatArray], lr: float) -> None:
        if not isinstance(params, dict):
            raise TypeError(
                f"params must be a dict of name -> ndarray (e.g. layer.params), got {type(params).__name__}"
            )
        if not params:
            raise ValueError("params must hold at least one parameter, got an empty dict")
        for name, param in params.items():
            if not isinstance(name, str):
                raise TypeError(f"params keys must be str, got {name!r}")
            if not isinstance(param, np.ndarray) or param.dtype.kind != "f":
                raise TypeError(
                    f"params[{name!r}] must be a float ndarray, got "
                    f"{type(param).__name__} of dtype {getattr(param, 'dtype', None)}"
                )
            if not param.flags.writeable:
                raise ValueError(f"params[{name!r}] must be writeable: it is updated in place")
        self.params = params
        self._layout = {name: (param.shape, param.dtype) for name, param in params.items()}
        self.lr = lr
        self.step_count = 0
        self.state = {
            f"{buffer}/{name}": np.zeros_like(param)
            for buffer in self._buffers
            for name, param in params.items()
        }

    @property
    def lr(self) -> float:
        """Learning rate (a float > 0); assignable between steps."""
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._lr = _positive(value, "lr")

    def _check_params(self):
        """The params dict must still hold the names, shapes and dtypes it was built with."""
        layout = {name: (param.shape, param.dtype) for name, param in self.params.items()}
        if layout != self._layout:
            changed = sorted(set(layout) ^ set(self._layout)) or sorted(
                name for name in layout if layout[name] != self._layout[name])
            raise ValueError(
                f"params changed since the optimizer was built (parameter {changed[0]!r}: "
                f"expected {self._layout.get(changed[0], 'absent')}, got "
                f"{layout.get(changed[0], 'absent')}); build a new optimizer for the new params"
            )

    def _check_grads(self, grads):
        if not isinstance(grads, dict):
            raise TypeError(f"grads must be a dict of name -> ndarray, got {type(grads).__name__}")
        unknown = sorted(set(grads) - set(self.params))
        if unknown:
            raise ValueError(
                f"grads has key {unknown[0]!r} that is not a parameter; expected keys "
                f"{sorted(self.params)}"
            )
        checked = {}
        for name, param in self.params.items():
            if name not in grads:
                raise ValueError(
                    f"grads is missing the gradient of parameter {name!r} (shape {param.shape})"
                )
            grad = np.asarray(grads[name])
            if grad.dtype.kind not in "biuf":
                raise TypeError(f"grads[{name!r}] must be real-valued, got dtype {grad.dtype}")
            if grad.shape != param.shape:
                raise ValueError(
                    f"grads[{name!r}] must have the shape of its parameter {param.shape}, "
                    f"got shape {grad.shape}"
                )
            checked[name] = grad.astype(param.dtype, copy=False)
        return checked

    def step(self, grads: Mapping[str, FloatArray]) -> None:
        """Update every parameter in place from its gradient.

        Parameters
        ----------
        grads : dict of str to ndarray
            Exactly the keys of ``params``, each with its parameter's shape
            (e.g. ``layer.grads``). Not modified.

        Raises
        ------
        ValueError
            If a gradient is missing, misshaped or not a parameter's, or if
            ``params`` gained, lost or reshaped a parameter since the
            optimizer was built; nothing is updated then.
        """
        self._check_params()
        grads = self._check_grads(grads)
        self.step_count += 1
        for name, param in self.params.items():
            self._update(name, param, grads[name])

    def _update(self, name, param, grad):
        raise NotImplementedError

    # -- state ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Array]:
        """Return a flat copy of the state, ready for ``np.savez``.

        Returns
        -------
        dict of str to ndarray
            ``"step"``: 0-d int64; ``"<buffer>/<param name>"``: a copy of each
            buffer (e.g. ``"exp_avg/W_query"``).
        """
        state: dict[str, Array] = {"step": np.array(self.step_count, dtype=np.int64)}
        state.update({key: value.copy() for key, value in self.state.items()})
        return state

    def load_state_dict(self, state: Mapping[str, ArrayLike]) -> None:
        """Restore a state from :meth:`state_dict` (e.g. read back with ``np.load``).

        Parameters
        ----------
        state : mapping of str to ndarray
            Exactly the keys of :meth:`state_dict`, with the same shapes and
            dtypes. An ``NpzFile`` works.

        Raises
        ------
        ValueError
            Naming the first missing, unexpected, misshaped or mistyped key.
            Nothing is changed when it raises.
        """
        try:
            keys = set(state.keys())
        except AttributeError:
            raise TypeError(
                f"state must be a mapping of str -> ndarray, got {type(state).__name__}"
            ) from None
        expected = self.state_dict()
        missing = sorted(set(expected) - keys)
        if missing:
            raise ValueError(f"optimizer state is missing key {missing[0]!r}")
        unexpected = sorted(keys - set(expected))
        if unexpected:
            raise ValueError(
                f"optimizer state has unexpected key {unexpected[0]!r} (expected keys "
                f"{sorted(expected)}; another optimizer or model?)"
            )
        loaded = {}
        for key, reference in expected.items():
            value = np.asarray(state[key])
            if value.shape != reference.shape:
                raise ValueError(
                    f"optimizer state {key!r} must have shape {reference.shape}, got shape {value.shape}"
                )
            if value.dtype != reference.dtype:
                raise ValueError(
                    f"optimizer state {key!r} must have dtype {reference.dtype}, got dtype {value.dtype}"
                )
            if key != "step" and not np.isfinite(value).all():
                raise ValueError(f"optimizer state {key!r} contains NaN or inf")
            loaded[key] = np.array(value, copy=True)
        step = int(loaded.pop("step"))
        if step < 0:
            raise ValueError(f"optimizer state 'step' must be >= 0, got {step}")
        self.step_count = step
        self.state = loaded

    def __repr__(self):
        settings = ", ".join(f"{k}={v!r}" for k, v in self._settings().items())
        return f"{type(self).__name__}({settings})"

    def _settings(self):
        return {"lr": self.lr}


class SGD(Optimizer):
    """Stochastic gradient descent with momentum, dampening, weight decay, Nesterov.

    Parameters
    ----------
    params : dict of str to ndarray
        The parameters to update in place, ``name -> array`` (a model's ``params``).
    lr : float
        Learning rate :math:`\\gamma > 0`.
    momentum : float
        :math:`\\mu \\ge 0`.
    dampening : float
        :math:`\\tau \\ge 0`.
    weight_decay : float
        L2 coefficient :math:`\\lambda \\ge 0`, added to the gradient.
    nesterov : bool
        Needs ``momentum > 0`` and ``dampening == 0`` (as PyTorch).

    Notes
    -----
    ``torch.optim.SGD``'s algorithm, at step :math:`t`:

    .. math::
        g_t &\\leftarrow g_t + \\lambda \\theta_{t-1} \\\\
        b_t &= g_t \\ (t = 1), \\quad \\mu b_{t-1} + (1 - \\tau) g_t \\ (t > 1) \\\\
        g_t &\\leftarrow g_t + \\mu b_t \\ \\text{(Nesterov)}, \\quad b_t \\ \\text{(otherwise)} \\\\
        \\theta_t &= \\theta_{t-1} - \\gamma g_t

    The momentum buffer ``momentum_buffer/<name>`` exists (zeros before the
    first step) only when ``momentum > 0``.

    Examples
    --------
    One plain step is exactly :math:`\\theta - \\gamma g`:

    >>> params = {"w": np.array([1.0, 2.0])}
    >>> SGD(params, lr=0.5).step({"w": np.array([2.0, -2.0])})
    >>> params["w"]
    array([0., 3.])
    """

    def __init__(self, params: dict[str, FloatArray], lr: float, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False) -> None:
        self.momentum = _at_least(momentum, "momentum", 0.0)
        self.dampening = _at_least(dampening, "dampening", 0.0)
        self.weight_decay = _at_least(weight_decay, "weight_decay", 0.0)
        if not isinstance(nesterov, (bool, np.bool_)):
            raise TypeError(f"nesterov must be a bool, got {type(nesterov).__name__}")
        if nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                "nesterov=True needs momentum > 0 and dampening == 0, got "
                f"momentum={self.momentum} and dampening={self.dampening}"
            )
        self.nesterov = bool(nesterov)
        self._buffers = ("momentum_buffer",) if self.momentum > 0 else ()
        super().__init__(params, lr)

    def _settings(self):
        return {"lr": self.lr, "momentum": self.momentum, "dampening": self.dampening,
                "weight_decay": self.weight_decay, "nesterov": self.nesterov}

    def _update(self, name, param, grad):
        lr, mu, tau, decay = self.lr, self.momentum, self.dampening, self.weight_decay
        if decay != 0:
            grad = grad + decay * param  # g <- g + lambda * theta
        if mu != 0:
            buf = self.state[f"momentum_buffer/{name}"]
            if self.step_count == 1:
                buf[...] = grad  # b_1 = g_1
            else:
                buf[...] = mu * buf + (1 - tau) * grad  # b_t = mu * b_{t-1} + (1 - tau) * g_t
            grad = grad + mu * buf if self.nesterov else buf  # g <- g + mu * b_t (Nesterov) or b_t
        param -= lr * grad  # theta_t = theta_{t-1} - lr * g


class Adam(Optimizer):
    """Adam, with optional L2 weight decay added to the gradient (``torch.optim.Adam``).

    Parameters
    ----------
    params : dict of str to ndarray
        The parameters to update in place, ``name -> array`` (a model's ``params``).
    lr : float
        :math:`\\gamma > 0`.
    betas : (float, float)
        :math:`(\\beta_1, \\beta_2)`, each in ``[0, 1)``.
    eps : float
        :math:`\\epsilon > 0`, added to :math:`\\sqrt{\\hat v}`.
    weight_decay : float
        :math:`\\lambda \\ge 0`: L2 penalty, **added to the gradient** (so it
        is rescaled by Adam). For decoupled decay use :class:`AdamW`.

    Notes
    -----
    At step :math:`t` (buffers ``exp_avg/<name>`` = m and
    ``exp_avg_sq/<name>`` = v, zeros before the first step):

    .. math::
        g_t &\\leftarrow g_t + \\lambda \\theta_{t-1} \\\\
        m_t &= \\beta_1 m_{t-1} + (1 - \\beta_1) g_t \\\\
        v_t &= \\beta_2 v_{t-1} + (1 - \\beta_2) g_t^2 \\\\
        \\theta_t &= \\theta_{t-1} - \\frac{\\gamma}{1 - \\beta_1^t}
            \\frac{m_t}{\\sqrt{v_t} / \\sqrt{1 - \\beta_2^t} + \\epsilon}

    The first step moves each entry by about :math:`\\gamma\\,\\mathrm{sign}(g)`
    (exactly :math:`\\gamma |g| / (|g| + \\epsilon)`).

    Examples
    --------
    >>> params = {"w": np.array([1.0, 1.0])}
    >>> Adam(params, lr=0.1).step({"w": np.array([3.0, -0.5])})
    >>> params["w"].round(6)
    array([0.9, 1.1])
    """

    _buffers = ("exp_avg", "exp_avg_sq")
    _decoupled = False

    def __init__(self, params: dict[str, FloatArray], lr: float = 0.001,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float | None = 1e-08,
                 weight_decay: float = 0.0) -> None:
        try:
            beta1, beta2 = betas
        except (TypeError, ValueError):
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}") from None
        self.betas = (_unit_interval(beta1, "betas[0]"), _unit_interval(beta2, "betas[1]"))
        self.eps = _positive(eps, "eps")
        self.weight_decay = _at_least(weight_decay, "weight_decay", 0.0)
        super().__init__(params, lr)

        self._flatten()

    def _settings(self):
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps,
                "weight_decay": self.weight_decay}

    def _flatten(self):
        """Lay the state out flat: per dtype, one array per buffer; ``state``'s entries are views.

        NOTE: the update then runs its formula lines chunk by chunk over all
        the parameters of a dtype instead of once per parameter (eleven numpy
        calls each), faster for models of a few small parameters such as
        kv-recall's (measured in benchmarks/NOTES.md). Elementwise ``+ - * /`` and
        ``sqrt`` round each entry the same whatever the array, so the
        trajectory is the same to the bit.
        """
        by_dtype = {}
        for name, param in self.params.items():
            by_dtype.setdefault(param.dtype, []).append(name)
        self._groups, self._views = [], {}
        for dtype, names in by_dtype.items():
            shapes = [self.params[name].shape for name in names]
            ends = np.cumsum([math.prod(shape) for shape in shapes]).tolist()
            starts = [0] + ends[:-1]
            flats = {}
            for buffer in self._buffers:
                flats[buffer] = np.empty(ends[-1], dtype)
                for name, lo, hi, shape in zip(names, starts, ends, shapes):
                    key = f"{buffer}/{name}"
                    view = flats[buffer][lo:hi].reshape(shape)
                    view[...] = self.state[key]
                    self.state[key] = self._views[key] = view
            self._groups.append(_FlatGroup(names, flats["exp_avg"], flats["exp_avg_sq"],
                                           starts, ends, {}))

    def load_state_dict(self, state: Mapping[str, ArrayLike]) -> None:
        super().load_state_dict(state)
        self._flatten()

    load_state_dict.__doc__ = Optimizer.load_state_dict.__doc__

    def step(self, grads: Mapping[str, FloatArray]) -> None:
        self._check_params()
        grads = self._check_grads(grads)
        if any(self.state[key] is not view for key, view in self._views.items()):
            self._flatten()  # a state array was replaced: lay the new values out
        buffers = [buffer for group in self._groups for buffer in (group.exp_avg, group.exp_avg_sq)]
        if _overlapping(list(grads.values()), list(self.params.values()) + buffers):
            # NOTE: a gradient that shares memory with a parameter or a buffer
            # (``step(model.params)``) would be read after a chunk wrote it
            grads = {name: grad.copy() for name, grad in grads.items()}
        self.step_count += 1
        for group in self._groups:
            self._update_group(group, grads)

    step.__doc__ = Optimizer.step.__doc__

    def _update_group(self, group, grads):
        """The update of every parameter of ``group`` (one dtype), chunk by chunk.

        A chunk gathers its entries of the gradients, updates its part of the
        buffers and writes its part of the parameters: each array is read
        (and the parameters and buffers written) once a step, in cache.
        Chunks are independent, so they are shared among the kernels' worker
        threads; elementwise, so the same bits however they are shared.
        """
        from .kernels._runtime import run_elementwise, threads_for

        params = [self.params[name] for name in group.names]
        flat_grads = [grads[name].reshape(-1) for name in group.names]  # read: copies if need be
        flat_params = [param.reshape(-1) if param.flags.c_contiguous else param.ravel()
                       for param in params]  # written: views, or copies written back below
        constants = self._constants(params[0].dtype.type)
        threads = threads_for(group.exp_avg.size, "min_parallel_entries")
        # NOTE: on 163 M parameters, chunks of 2**15 entries measured faster on one
        # thread (in L2) and of 2**17 on two (shorter numpy calls wait on the GIL)
        size = _CHUNK if threads == 1 else 4 * _CHUNK
        if size not in group.plans:
            group.plans[size] = _chunk_pieces(group.starts, group.ends, size)

        def task(chunks):
            scratch = np.empty((3, size), params[0].dtype)  # g, a temporary, the update
            for chunk in chunks:
                self._update_chunk(chunk, flat_grads, flat_params, group, constants, scratch)

        run_elementwise(task, group.plans[size], group.exp_avg.size)
        for param, flat in zip(params, flat_params):
            if not param.flags.c_contiguous:
                param[...] = flat.reshape(param.shape)

    def _constants(self, kind):
        """The step's scalars, those that multiply parameters of the parameters' dtype ``kind``.

        NOTE: numpy 1 computed a 0-d float32 array times a Python float in float64."""
        lr, (beta1, beta2), eps, decay = self.lr, self.betas, self.eps, self.weight_decay
        step = float(self.step_count)
        return _AdamConstants(
            decay=kind(decay) if decay != 0 and not self._decoupled else None,
            shrink=kind(1 - lr * decay) if decay != 0 and self._decoupled else None,
            beta1=beta1, beta2=beta2, eps=eps,
            step_size=lr / (1 - beta1**step),  # lr / (1 - beta1^t)
            bias2=(1 - beta2**step) ** 0.5)  # sqrt(1 - beta2^t)

    @staticmethod
    def _update_chunk(chunk, grads, params, group, c, scratch):
        """The formula lines on the entries ``chunk.start:chunk.stop`` of the group."""
        start, stop, pieces = chunk
        g, temp, update = scratch[:, :stop - start]
        m, v = group.exp_avg[start:stop], group.exp_avg_sq[start:stop]
        for i, lo, hi, at in pieces:
            g[at:at + hi - lo] = grads[i][lo:hi]  # g, this chunk's entries
            if c.decay is not None:  # g <- g + lambda * theta  (Adam's L2)
                np.multiply(params[i][lo:hi], c.decay, out=temp[at:at + hi - lo])
                g[at:at + hi - lo] += temp[at:at + hi - lo]
        # NOTE: m is updated as torch's lerp(m, g, 1 - beta1) for beta1 > 0.5,
        # m + (1 - beta1) (g - m): beta1 m + (1 - beta1) g up to rounding. torch's
        # CPU kernels fuse some of these lines (FMA), so single entries may differ
        # from torch by an ulp; trajectories agree to ~1e-15 (tests/test_optim.py).
        # NOTE: each line's operations in the same order as the formula beside it
        # (the same rounding), into the chunk's own arrays, not temporaries
        np.subtract(g, m, out=temp)
        temp *= 1 - c.beta1
        m += temp  # m_t = beta1 * m_{t-1} + (1 - beta1) * g
        v *= c.beta2  # v_t = beta2 * v_{t-1} + ...
        np.multiply(g, 1 - c.beta2, out=temp)
        temp *= g
        v += temp  # ... + (1 - beta2) * g^2
        np.sqrt(v, out=temp)
        temp /= c.bias2
        temp += c.eps  # denom = sqrt(v_t / (1 - beta2^t)) + eps
        np.multiply(m, c.step_size, out=update)
        update /= temp  # step_size * m_t / denom
        for i, lo, hi, at in pieces:
            theta = params[i][lo:hi]
            if c.shrink is not None:
                theta *= c.shrink  # theta <- theta * (1 - lr * lambda)  (AdamW)
            theta -= update[at:at + hi - lo]  # theta_t = theta_{t-1} - step_size * m_t / denom


#: Entries of the flat arrays updated together (at one thread; four times as many on more).
_CHUNK = 32768

_AdamConstants = namedtuple("_AdamConstants", "decay shrink beta1 beta2 eps step_size bias2")


def _chunk_pieces(starts, ends, size):
    """The flat range ``[0, ends[-1])`` cut in chunks of ``size`` entries.

    Each chunk is ``(start, stop, pieces)``, a piece ``(i, lo, hi, at)``:
    entries ``lo:hi`` of parameter ``i`` (flattened) are the chunk's entries
    ``at:at + hi - lo``.
    """
    chunks, i = [], 0
    for start in range(0, ends[-1], size):
        stop = min(start + size, ends[-1])
        pieces = []
        while i < len(ends) and starts[i] < stop:
            lo, hi = max(starts[i], start), min(ends[i], stop)
            if hi > lo:
                pieces.append((i, lo - starts[i], hi - starts[i], lo - start))
            if ends[i] > stop:
                break  # the parameter goes on in the next chunk
            i += 1
        chunks.append((start, stop, tuple(pieces)))
    return chunks


def _overlapping(reads, writes):
    """Whether an array of ``reads`` may share memory with one of ``writes`` (spans, sorted)."""
    bounds = getattr(np, "byte_bounds", None) or np.lib.array_utils.byte_bounds  # numpy 1, 2
    spans = sorted([(*bounds(a), 0) for a in reads if a.size]
                   + [(*bounds(a), 1) for a in writes if a.size])
    reach = {0: -1, 1: -1}  # the furthest end seen of each kind so far
    for lo, hi, kind in spans:
        if reach[1 - kind] > lo:
            return True
        reach[kind] = max(reach[kind], hi)
    return False


_FlatGroup = namedtuple("_FlatGroup", "names exp_avg exp_avg_sq starts ends plans")
_FlatGroup.__doc__ = """The flat buffers of :class:`Adam`'s parameters of one dtype.

names : the parameters' names, in ``params``' order. exp_avg, exp_avg_sq :
flat arrays of all their entries (``state`` holds parameter-shaped views of
them). starts, ends : each parameter's range in them. plans : chunk size ->
:func:`_chunk_pieces` of the flat range, made at the first step that uses it.
"""


class AdamW(Adam):
    """Adam with decoupled weight decay (``torch.optim.AdamW``).

    Parameters
    ----------
    params : dict of str to ndarray
        The parameters to update in place, ``name -> array`` (a model's ``params``).
    lr : float
        Learning rate.
    betas : (float, float)
        Decay rates of the running means of the gradient and of its square.
    eps : float
        Added to the square root of the second moment, for stability.
    weight_decay : float
        :math:`\\lambda \\ge 0` (default ``1e-2``, as PyTorch): each step first
        shrinks the parameters, :math:`\\theta \\leftarrow \\theta (1 - \\gamma\\lambda)`,
        then takes the Adam step with the *undecayed* gradient.

    Notes
    -----
    Same as :class:`Adam` except the decay line; with ``weight_decay=0`` the
    two are identical.

    Examples
    --------
    A zero gradient still shrinks the weights:

    >>> params = {"w": np.array([2.0])}
    >>> AdamW(params, lr=0.1, weight_decay=0.5).step({"w": np.array([0.0])})
    >>> params["w"]
    array([1.9])
    """

    _decoupled = True

    def __init__(self, params: dict[str, FloatArray], lr: float = 0.001,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float | None = 1e-08,
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def clip_grad_norm(grads: Mapping[str, FloatArray], max_norm: float, norm_type: float = 2.0, *,
                   error_if_nonfinite: bool = False) -> float:
    """Scale every gradient in place so that their joint norm is at most ``max_norm``.

    ``torch.nn.utils.clip_grad_norm_``: the total norm is the ``norm_type``
    norm of all the arrays taken as one vector (``inf``: the largest
    magnitude); each array is multiplied by
    ``min(max_norm / (total_norm + 1e-6), 1)``.

    Parameters
    ----------
    grads : dict of str to ndarray
        E.g. ``model.grads``; float arrays, edited in place.
    max_norm : float
        ``> 0``.
    norm_type : float
        ``> 0``, or ``inf``.
    error_if_nonfinite : bool, keyword-only
        As torch's: True raises ``ValueError`` (nothing scaled) when the
        total norm is NaN or inf; False (torch's default) scales by the
        coefficient the formula gives (NaN turns the gradients to NaN, as
        torch does) and returns the norm.

    Returns
    -------
    float
        The total norm before clipping.

    Raises
    ------
    ValueError
        If ``max_norm`` or ``norm_type`` is not positive, or on a
        non-finite norm with ``error_if_nonfinite``.
    TypeError
        If ``grads`` is not a mapping of float arrays.

    Examples
    --------
    >>> grads = {"W": np.array([3.0, 4.0])}
    >>> clip_grad_norm(grads, 1.0)
    5.0
    >>> grads["W"].round(6)
    array([0.6, 0.8])
    """
    max_norm = _positive(max_norm, "max_norm")
    if isinstance(norm_type, (bool, np.bool_)) or not isinstance(norm_type, numbers.Real) \
            or not float(norm_type) > 0:
        raise ValueError(f"norm_type must be a positive real number or inf, got {norm_type!r}")
    norm_type = float(norm_type)
    if not hasattr(grads, "values"):
        raise TypeError(f"grads must be a dict of name -> ndarray, got {type(grads).__name__}")
    arrays = list(grads.values())
    for name, grad in grads.items():
        if not isinstance(grad, np.ndarray) or grad.dtype.kind != "f":
            raise TypeError(f"grads[{name!r}] must be a float ndarray (scaled in place), got "
                            f"{type(grad).__name__}")
    if not arrays:
        return 0.0
    if norm_type == math.inf:
        total = max(float(np.abs(grad).max(initial=0.0)) for grad in arrays)
    else:
        # NOTE: torch's order: each array's norm, then the norm of those norms
        norms = np.array([np.linalg.norm(grad.ravel(), norm_type) for grad in arrays])
        total = float(np.linalg.norm(norms, norm_type))
    if error_if_nonfinite and not math.isfinite(total):
        raise ValueError(f"the total norm of order {norm_type} of the gradients is {total}; "
                         "nothing was scaled (error_if_nonfinite=True)")
    coefficient = min(max_norm / (total + 1e-6), 1.0) if not math.isnan(total) else math.nan
    with np.errstate(invalid="ignore"):  # inf * 0 is NaN, as in torch
        for grad in arrays:
            grad *= coefficient
    return total
