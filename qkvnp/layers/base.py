"""The layer contract (:class:`Layer`) and the container of layers (:class:`Model`).

Every layer of :mod:`qkvnp.layers` and every model of :mod:`qkvnp.training`
is a :class:`Layer`: ``params`` and ``grads`` dicts, ``forward`` keeping the
cache of its last call, ``backward`` adding into ``grads``, ``state_dict`` /
``load_state_dict`` for saving and loading weights. A :class:`Model` holds
layers assigned to its attributes, as a PyTorch ``Module`` does.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import namedtuple
from collections.abc import Mapping

import numpy as np

from .._checks import check_state_value
from .transaction import add_grad, add_grads, journal, transactional

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from typing import Any
    from .._typing import ArrayLike, FloatArray

__all__ = ["Layer", "Model", "LoadResult", "xavier_uniform"]

LoadResult = namedtuple("LoadResult", "missing_keys unexpected_keys")
LoadResult.__doc__ = """What :meth:`Layer.load_state_dict` did not load (as PyTorch's).

missing_keys : list of str, parameters the dict did not have (left as they were).
unexpected_keys : list of str, entries of the dict that are no parameter (ignored).
"""


class _ThreadState(threading.local):
    """One thread's view of a layer: its last forward's cache and what it ran."""

    cache = None  # the cache of this thread's last forward, until a backward uses it up
    used_cache = None  # the cache the last backward used up (until the next forward)
    used = False  # a backward used up a cache (the message of a second backward)
    decoded = False  # the last forward was a kv_cache decoding step
    dispatch = None  # the path the last forward ran (attention layers)


def xavier_uniform(rng, fan_in, fan_out, dtype):
    """Glorot/Xavier uniform ``(fan_in, fan_out)``: U(-a, a), a = sqrt(6/(fan_in+fan_out))."""
    bound = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-bound, bound, size=(fan_in, fan_out)).astype(dtype)


class Layer(ABC):
    """Base class of every layer: the contract a model relies on.

    A layer holds ``params`` and ``grads`` (dicts with the same keys and
    shapes). ``forward`` keeps the cache of its **last** call only (two
    forwards, then a backward, give the gradient of the second;
    :mod:`qkvnp.functional`'s ``(out, cache)`` pairs are the way to hold
    several), and ``backward`` **adds** into ``grads``, returns the gradient
    of the inputs and uses the cache up (a second ``backward`` of one forward
    raises ``RuntimeError`` unless the first got ``retain_cache=True``). The
    cache owns what the backward reads: editing an input or a returned array
    in place after ``forward`` does not change the gradients.
    ``zero_grad()`` resets the gradients. ``state_dict()`` returns copies of
    the parameters and ``load_state_dict(d)`` writes into them in place (so
    that optimizers and models holding the arrays see the new values).
    Subclasses fill ``self.params`` in
    ``__init__``, call ``self.zero_grad()``, and list their constructor
    arguments in ``_repr_fields`` for ``repr``.

    ``training`` (True by default, as in PyTorch) is set by ``train()`` and
    ``eval()``: drawn dropout runs only in training mode.

    **Parameters edited between forward and backward.** A backward
    differentiates the forward as it ran: its cache holds the weights that
    forward read (copies, or arrays made from them such as the fused
    ``[c W_q, W_k, W_v]``), never the parameter arrays themselves. An
    optimizer ``step``, a ``load_state_dict`` or an in-place write
    (``layer.params["W_out"] *= 2``) after the forward changes the next
    forward, not the gradients of this one, on every path (``reference``,
    ``fast``, ``tiled``, ``auto``), as if the edit came after the backward.
    (A version counter could not see numpy's in-place writes; the copies
    cost a pass over the weights a forward, small next to the products that
    read them.)

    **Threads.** The cache is kept per thread: a backward uses the cache of
    the **calling thread's** last forward, so threads sharing a layer may
    each run their forward/backward pairs. Forwards write only into memory
    they own (nothing is reused from an earlier call), so concurrent
    forwards return exactly what serial calls return. Backwards from several
    threads add into ``grads`` under a lock, as if run one after another
    (the layers of :mod:`qkvnp.layers`; a :class:`qkvnp.Model` subclass's own
    backward adds as it writes it).
    ``training``, ``params`` and the dropout Generator are shared: change
    them while no other thread runs the layer.

    **Refused calls.** A forward or backward that raises leaves the layer
    as it was: its cache, its gradients and its parameters. A
    :class:`qkvnp.Model`'s calls are transactions, so the same holds for a
    composite however late its refusal comes.

    ``copy.deepcopy`` (and pickling) copies the parameters, gradients and
    settings, not the per-thread caches.
    """

    params: dict
    grads: dict
    _repr_fields: tuple = ()
    training = True

    def train(self, mode: bool = True) -> Layer:
        """Set training mode (``mode=True``) or evaluation mode; return the layer.

        In training mode a layer with ``dropout > 0`` draws a dropout mask on
        every forward; in evaluation mode it draws none (a ``dropout_mask``
        given to ``forward`` still applies).
        """
        if not isinstance(mode, (bool, np.bool_)):
            raise TypeError(f"mode must be a bool, got {type(mode).__name__} {mode!r}")
        self.training = bool(mode)
        return self

    def eval(self) -> Layer:
        """Evaluation mode: ``train(False)``. Returns the layer."""
        return self.train(False)

    def generators(self) -> dict[str, np.random.Generator]:
        """The layer's own random Generators by name (dropout's), for checkpoints.

        Their states (``bit_generator.state``) are what a training checkpoint
        saves so that a resumed run draws the same dropout masks.
        """
        return {}

    @abstractmethod
    def forward(self, *inputs: Any, **options: Any) -> Any:
        """Compute the output and keep what ``backward`` needs."""

    @abstractmethod
    def backward(self, dout: FloatArray, retain_cache: bool = False) -> Any:
        """Accumulate into ``grads`` and return the gradient of the inputs.

        A backward uses up the cache of its forward (a second one raises
        ``RuntimeError``) unless ``retain_cache=True``, like PyTorch's
        ``retain_graph``.
        """

    def zero_grad(self) -> None:
        """Reset every gradient to zeros of its parameter's shape and dtype."""
        # NOTE: np.zeros, not zeros_like (a Python function): 0.36 against 1.37 us an array
        self.grads = {name: np.zeros(p.shape, p.dtype) for name, p in self.params.items()}

    def state_dict(self) -> dict[str, FloatArray]:
        """Copies of the parameters, keyed by their names in ``params``.

        Returns
        -------
        dict
            ``name -> ndarray`` (copies: editing them does not change the layer).

        Examples
        --------
        >>> from qkvnp import Linear
        >>> layer = Linear(3, 2, rng=0)
        >>> state = layer.state_dict()
        >>> sorted(state), state["W"] is layer.params["W"]
        (['W', 'b'], False)
        """
        return {name: value.copy() for name, value in self.params.items()}

    def load_state_dict(self, state_dict: Mapping[str, ArrayLike],
                        strict: bool = True) -> LoadResult:
        """Copy ``state_dict``'s values into the parameters, in place.

        The arrays of ``params`` are kept (optimizers and models share them)
        and overwritten. Everything is checked before anything is written: a
        refused dict leaves the layer as it was.

        Parameters
        ----------
        state_dict : mapping
            ``name -> array_like`` (numpy arrays, or anything with torch's
            ``.detach().cpu().numpy()``), under the names of ``params``.
            Values are cast to their parameter's dtype.
        strict : bool
            Refuse missing and unexpected keys. With False, load the keys
            both have and return the others.

        Returns
        -------
        LoadResult
            ``(missing_keys, unexpected_keys)``, empty lists when strict.

        Raises
        ------
        TypeError
            If ``state_dict`` is not a mapping or a value does not hold real
            numbers.
        ValueError
            If ``strict`` and keys are missing or unexpected (the message
            lists them), or a value has another shape than its parameter,
            or holds NaN or inf (before or after the cast).

        Examples
        --------
        >>> from qkvnp import Linear
        >>> layer = Linear(3, 2, rng=0)
        >>> W = layer.params["W"]
        >>> layer.load_state_dict({"W": np.ones((3, 2)), "b": [0, 0]})
        LoadResult(missing_keys=[], unexpected_keys=[])
        >>> layer.params["W"] is W, float(W[0, 0])
        (True, 1.0)
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of name -> array, got "
                            f"{type(state_dict).__name__}")
        params = self.params
        missing = [name for name in params if name not in state_dict]
        unexpected = [name for name in state_dict if name not in params]
        if strict and (missing or unexpected):
            raise ValueError(f"{type(self).__name__}.load_state_dict: missing keys {missing}, "
                             f"unexpected keys {unexpected}; expected {list(params)}")
        values = {}
        for name, target in params.items():
            if name not in state_dict:
                continue
            values[name] = check_state_value(state_dict[name], f"state_dict[{name!r}]",
                                             target.shape, target.dtype)
        for name, value in values.items():  # all checked: now write
            np.copyto(params[name], value)
        return LoadResult(missing, unexpected)

    def num_parameters(self) -> int:
        """Total number of scalar parameters."""
        return sum(p.size for p in self.params.values())

    def _repr_items(self):
        """``(name, value)`` of the constructor arguments ``repr`` shows."""
        return [(name, getattr(self, name)) for name in self._repr_fields]

    def __repr__(self):
        """The constructor call, PyTorch style: ``SelfAttention(d_in=3, d_out=2, ...)``."""
        fields = [f"{name}={np.dtype(value).name if name == 'dtype' else repr(value)}"
                  for name, value in self._repr_items()]
        return f"{type(self).__name__}({', '.join(fields)})"

    def _accumulate(self, name, grad):
        """Add ``grad`` into ``self.grads[name]``: locked, or kept until a composite's
        call commits (:mod:`qkvnp.layers.transaction`)."""
        add_grad(self, "grads", name, grad)

    def _accumulate_all(self, grads):
        """:meth:`_accumulate` each ``grads[name]`` whose name ``self.grads`` shares."""
        own = self.grads
        add_grads(self, "grads", {name: grad for name, grad in grads.items() if name in own})

    @property
    def _thread(self) -> _ThreadState:
        """The calling thread's state of this layer: its last forward's cache and dispatch.

        NOTE: made on first use, not in a ``__new__``, so that a layer's
        signature is its ``__init__``'s (``inspect.signature``, the API
        reference) and subclasses need not chain ``__init__``.
        """
        try:
            return self.__dict__["_thread_state"]
        except KeyError:  # dict.setdefault is atomic: two threads get the same state
            return self.__dict__.setdefault("_thread_state", _ThreadState())

    def _save_state(self):
        """The calling thread's state of the layer, for :mod:`qkvnp.layers.transaction`'s journal."""
        state = self._thread
        return state.cache, state.used_cache, state.used, state.decoded, state.dispatch

    def _restore_state(self, saved):
        """Put back what :meth:`_save_state` returned (a refused composite call)."""
        state = self._thread
        state.cache, state.used_cache, state.used, state.decoded, state.dispatch = saved

    def _state_to_write(self):
        """The calling thread's state, journaled first when a composite's call is open."""
        journal(self)
        return self._thread

    @property
    def _cache(self):
        """The cache of the calling thread's last forward (None once used up)."""
        return self._thread.cache

    @_cache.setter
    def _cache(self, cache):
        state = self._state_to_write()
        state.cache, state.used_cache = cache, None
        if cache is not None:
            state.used = state.decoded = False

    @property
    def _used_cache(self):
        """The cache the calling thread's last backward used up, until its next forward."""
        return self._thread.used_cache

    def __getstate__(self):
        """For ``copy`` and ``pickle``: everything but the per-thread caches."""
        state = dict(self.__dict__)
        state.pop("_thread_state", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    def _need_cache(self):
        """The cache of the last forward, or a ``RuntimeError`` saying what to call."""
        state = self._thread
        if state.cache is None:
            name = type(self).__name__
            if not state.used:
                raise RuntimeError(f"{name}.backward called before forward: call forward(...) first")
            raise RuntimeError(f"{name}.backward called twice for one forward: call forward(...) "
                               "again (retain_cache=True keeps a cache for one more backward)")
        return state.cache

    def _release_cache(self, retain_cache):
        """After a successful backward: drop the cache unless ``retain_cache``.

        NOTE: as PyTorch frees the graph unless ``retain_graph=True``: else a
        second backward would silently add the same gradients twice. The used
        cache stays readable as ``_used_cache`` (the tests look at what ran)
        until the thread's next forward, which drops it first.
        """
        if not retain_cache:
            state = self._state_to_write()
            state.used_cache, state.cache, state.used = state.cache, None, True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)


class Model(Layer):
    """A container of layers: one ``params``/``grads`` over its sub-layers' arrays.

    As in PyTorch, a sub-layer registers when it is assigned as an attribute
    (``model.attn = MultiHeadAttention(...)``); ``params`` and ``grads`` then
    hold its arrays under dotted names (``"attn.W_query"``), the very arrays,
    not copies, so that one optimizer built on ``model.params`` trains every
    layer. Models nest (``"block.attn.W_query"``). ``zero_grad``,
    ``state_dict``, ``load_state_dict``, ``train``/``eval`` and
    ``generators`` reach every sub-layer.

    A subclass defines ``forward``/``backward`` (calling its sub-layers') and
    may keep its own arrays in ``self._own`` (name -> array, listed first in
    ``params``, with gradients in ``self._own_grads``, added into with
    ``self._accumulate_own``); it calls ``self.zero_grad()`` at the end of
    ``__init__``.

    **A subclass's calls are transactions** (``qkvnp/layers/transaction.py``):
    its ``forward``, ``backward`` and ``decode`` either succeed whole or
    change nothing. If one raises, however late and whatever it raises
    (``KeyboardInterrupt`` included), every sub-layer's per-thread cache,
    every :class:`~qkvnp.KVCache` the call appended to and the model's
    dropout Generators get back the state they had before it; a backward's
    gradients are added into ``grads`` only once the whole backward has
    returned, all under one lock. Inside a subclass's ``backward``, ``grads``
    therefore hold the earlier calls' sum, not yet this call's. ``Model()`` itself can
    hold layers for an optimizer while you call them yourself; its
    ``forward`` raises ``NotImplementedError``.

    Examples
    --------
    >>> from qkvnp import Linear, Model, MultiHeadAttention
    >>> model = Model()
    >>> model.attn = MultiHeadAttention(8, 2, rng=0)
    >>> model.head = Linear(8, 3, rng=0)
    >>> model.params["attn.W_query"] is model.attn.params["W_query"]
    True
    >>> list(model.params)[:2]
    ['attn.W_query', 'attn.W_key']
    >>> y = model.head.forward(model.attn.forward(np.ones((5, 8))))  # (5, 8) -> (5, 3)
    >>> dx = model.attn.backward(model.head.backward(np.ones((5, 3))))
    >>> model.grads["head.b"]
    array([5., 5., 5.])
    >>> model.zero_grad(); model.grads["head.b"]
    array([0., 0., 0.])
    """

    def __init__(self) -> None:
        self.zero_grad()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Make the subclass's ``forward``, ``backward`` and ``decode`` transactions.

        NOTE: the guarantee of a refused call is the base class's mechanism,
        not each model's habit: a subclass's call that raises restores its
        sub-layers' caches, KV caches and Generators, and adds no gradient
        (:mod:`qkvnp.layers.transaction`).
        """
        super().__init_subclass__(**kwargs)
        for name in ("forward", "backward", "decode"):
            method = cls.__dict__.get(name)
            if callable(method) and not getattr(method, "transactional", False):
                setattr(cls, name, transactional(method))

    def __setattr__(self, name, value):
        """Register a :class:`Layer` assigned as an attribute (PyTorch's ``Module``)."""
        layers = self.__dict__.setdefault("_layers", {})
        if isinstance(value, Layer):
            if value is self:
                raise ValueError(f"a model cannot hold itself as {name!r}")
            layers[name] = value
        else:
            layers.pop(name, None)
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        self.__dict__.get("_layers", {}).pop(name, None)
        object.__delattr__(self, name)

    @property
    def _own(self):
        """The model's own arrays (name -> array); none unless a subclass sets them."""
        return self.__dict__.setdefault("_own_params", {})

    @_own.setter
    def _own(self, arrays):
        self.__dict__["_own_params"] = arrays

    @property
    def params(self) -> dict[str, FloatArray]:
        """Flat dict ``"prefix.name" -> array``, sharing the sub-layers' arrays.

        A new dict on each access, whose item assignment writes through:
        ``model.params["attn.W_query"] = array`` puts ``array`` into
        ``model.attn.params`` too (the gradient checker's complex step
        swaps a parameter for a complex copy that way). Assigning the whole
        dict, ``model.params = {...}``, does the same for each entry.
        """
        return _LinkedDict(self, "params", self._flat("params"))

    @params.setter
    def params(self, arrays: Any) -> None:
        self._assign("params", arrays)

    @property
    def grads(self) -> dict[str, FloatArray]:
        """Flat dict ``"prefix.name" -> array``: the sub-layers' gradient arrays.

        Writes through as :attr:`params` does.
        """
        return _LinkedDict(self, "grads", self._flat("grads"))

    @grads.setter
    def grads(self, arrays: Any) -> None:
        self._assign("grads", arrays)

    def _flat(self, kind):
        """The model's own arrays of ``kind`` ("params" or "grads"), then its sub-layers'."""
        own = self._own if kind == "params" else self.__dict__.get("_own_grads", {})
        flat = {name: own[name] for name in self._own}
        for prefix, layer in self.__dict__.get("_layers", {}).items():
            for name, value in getattr(layer, kind).items():
                flat[f"{prefix}.{name}"] = value
        return flat

    def _assign(self, kind, arrays):
        """Put each ``name -> array`` of ``arrays`` where ``kind``'s entry of that name lives."""
        names = set(self._flat(kind))
        if set(arrays) != names:
            raise ValueError(f"{type(self).__name__}.{kind} must be assigned every one of its "
                             f"names {sorted(names)}, got {sorted(arrays)}")
        for name, value in arrays.items():
            self._set_entry(kind, name, value)

    def _set_entry(self, kind, name, value):
        """``kind[name] = value`` in the layer (or the model's own dict) that holds ``name``."""
        if name in self._own:
            if kind == "params":
                self._own[name] = value
            else:
                self.__dict__.setdefault("_own_grads", {})[name] = value
            return
        for prefix, layer in self.__dict__.get("_layers", {}).items():
            if name.startswith(prefix + "."):
                rest = name[len(prefix) + 1:]
                target = getattr(layer, kind)
                if rest in target:
                    target[rest] = value  # a sub-model's dict writes through in turn
                    return
        raise KeyError(f"{type(self).__name__} has no {kind} entry {name!r}")

    def named_layers(self) -> Any:
        """Every sub-layer, nested ones included, as ``(dotted name, layer)`` pairs.

        Depth first, in registration order (PyTorch's ``named_modules``
        without the model itself).
        """
        found = []
        for prefix, layer in self.__dict__.get("_layers", {}).items():
            found.append((prefix, layer))
            if isinstance(layer, Model):
                found.extend((f"{prefix}.{name}", sub) for name, sub in layer.named_layers())
        return found

    def train(self, mode: bool = True) -> Layer:
        """Set the mode of the model and of every sub-layer; return the model."""
        super().train(mode)
        for layer in self.__dict__.get("_layers", {}).values():
            layer.train(mode)
        return self

    def generators(self) -> dict[str, np.random.Generator]:
        """The model's own Generators and its sub-layers', under dotted names."""
        found = dict(getattr(self, "_own_generators", {}))
        for prefix, layer in self.__dict__.get("_layers", {}).items():
            for name, generator in layer.generators().items():
                found[f"{prefix}.{name}"] = generator
        return found

    def _accumulate_own(self, name, grad):
        """Add ``grad`` into the gradient of the model's own array ``name``, as
        :meth:`Layer._accumulate` does (locked, or at the call's commit)."""
        add_grad(self, "_own_grads", name, grad)

    def zero_grad(self) -> None:
        """Reset every gradient (the sub-layers' and the model's own) to zeros."""
        for layer in self.__dict__.get("_layers", {}).values():
            layer.zero_grad()
        self._own_grads = {name: np.zeros(value.shape, value.dtype)
                           for name, value in self._own.items()}

    def forward(self, *inputs: Any, **options: Any) -> Any:
        """A plain ``Model`` has no forward: subclass it, or call the sub-layers."""
        raise NotImplementedError(f"{type(self).__name__} defines no forward: subclass "
                                  "qkvnp.Model and define forward/backward, or call its "
                                  "sub-layers yourself")

    def backward(self, dout: FloatArray, retain_cache: bool = False) -> Any:
        """A plain ``Model`` has no backward: subclass it, or call the sub-layers."""
        raise NotImplementedError(f"{type(self).__name__} defines no backward: subclass "
                                  "qkvnp.Model and define forward/backward, or call its "
                                  "sub-layers yourself")

    def __repr__(self):
        """PyTorch style: the sub-layers, one per line, under their names."""
        lines = [f"  ({name}): " + repr(layer).replace("\n", "\n  ")
                 for name, layer in self.__dict__.get("_layers", {}).items()]
        return f"{type(self).__name__}(" + ("\n" + "\n".join(lines) + "\n" if lines else "") + ")"


class _LinkedDict(dict):
    """A snapshot dict of a :class:`Model`'s arrays whose item assignment writes through."""

    def __init__(self, model, kind, items):
        super().__init__(items)
        self._model, self._kind = model, kind

    def __setitem__(self, name, value):
        self._model._set_entry(self._kind, name, value)  # refuses an unknown name
        super().__setitem__(name, value)

    def __reduce__(self):
        return dict, (dict(self),)  # a copy (deepcopy, pickle) is a plain dict of the arrays
