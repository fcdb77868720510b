"""The layer contract (:class:`Layer`) and the container of layers (:class:`Model`).

Every layer of :mod:`qkvnp.layers` and every model of :mod:`qkvnp.training`
is a :class:`Layer`: ``params`` and ``grads`` dicts, ``forward`` keeping the
cache of its last call, ``backward`` adding into ``grads``.
"""
from abc import ABC, abstractmethod

import numpy as np

__all__ = ["Layer", "Model", "xavier_uniform"]


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
    ``zero_grad()`` resets the gradients. Subclasses fill ``self.params`` in
    ``__init__``, call ``self.zero_grad()``, and list their constructor
    arguments in ``_repr_fields`` for ``repr``.
    """

    params: dict
    grads: dict
    _repr_fields: tuple = ()

    @abstractmethod
    def forward(self, *inputs, **options):
        """Compute the output and keep what ``backward`` needs."""

    @abstractmethod
    def backward(self, dout, retain_cache=False):
        """Accumulate into ``grads`` and return the gradient of the inputs.

        A backward uses up the cache of its forward (a second one raises
        ``RuntimeError``) unless ``retain_cache=True``, like PyTorch's
        ``retain_graph``.
        """

    def zero_grad(self):
        """Reset every gradient to zeros of its parameter's shape and dtype."""
        self.grads = {name: np.zeros_like(p) for name, p in self.params.items()}

    def num_parameters(self):
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
        if grad is not None:
            self.grads[name] += grad

    def _need_cache(self):
        """The cache of the last forward, or a ``RuntimeError`` saying what to call."""
        if getattr(self, "_cache", None) is None:
            name = type(self).__name__
            if getattr(self, "_used_cache", None) is None:
                raise RuntimeError(f"{name}.backward called before forward: call forward(...) first")
            raise RuntimeError(f"{name}.backward called twice for one forward: call forward(...) "
                               "again (retain_cache=True keeps a cache for one more backward)")
        return self._cache

    def _release_cache(self, retain_cache):
        """After a successful backward: drop the cache unless ``retain_cache``.

        NOTE: as PyTorch frees the graph unless ``retain_graph=True``: else a
        second backward would silently add the same gradients twice. The used
        cache stays aside only for the next forward to reuse its buffers.
        """
        if not retain_cache:
            self._used_cache, self._cache = self._cache, None

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class Model(Layer):
    """Flat ``params``/``grads`` over named sub-layers and the model's own arrays.

    A :class:`~qkvnp.layers.Layer` whose ``params`` are assembled from its
    sub-layers' (shared arrays, not copies).

    Subclasses set ``self._layers`` (prefix -> layer) and ``self._own``
    (name -> array) and call ``self.zero_grad()`` at the end of ``__init__``.
    """

    _layers: dict
    _own: dict

    @property
    def params(self):
        """Flat dict ``"prefix.name" -> array``, sharing the sub-layers' arrays."""
        flat = dict(self._own)
        for prefix, layer in self._layers.items():
            for name, value in layer.params.items():
                flat[f"{prefix}.{name}"] = value
        return flat

    def zero_grad(self):
        """Reset every gradient (the sub-layers' and the model's own) to zeros."""
        for layer in self._layers.values():
            layer.zero_grad()
        self._own_grads = {name: np.zeros_like(value) for name, value in self._own.items()}
        self.grads = dict(self._own_grads)
        for prefix, layer in self._layers.items():
            for name, value in layer.grads.items():
                self.grads[f"{prefix}.{name}"] = value
