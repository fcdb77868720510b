"""Dropout and the checker: refuse a forward that draws, or replay its draws.

Shape key: none; the checker never looks inside a checked tensor.

Numerical derivatives compare forwards at nearby points, so the forward must
be a function of the checked tensors. A layer in training mode with a
dropout probability above 0 draws a new mask on every forward: differences
of two forwards then measure the change of mask, not of the input (numerical
gradients of 1e5 where the analytic ones are of 1). :func:`guarded_evaluate`
wraps a problem's forward:

* without ``replay_dropout``, it refuses (``ValueError``) a forward that
  drew from one of the layer's Generators (``layer.generators()``, every
  sub-layer's included) or from a Generator in ``forward_kwargs``, or whose
  output at the unperturbed point changed between two calls. The message
  names the sub-layers with active dropout, ``model.eval()`` and
  ``replay_dropout=True`` (:func:`check_repeat` compares the two outputs);
* with ``replay_dropout=True``, it puts every such Generator back to the
  state it had before the first forward before each forward, so that every
  forward draws the same masks: the checked function is the forward with
  those masks held fixed, which is what its backward differentiates.

Fixed masks given as forward arguments (``dropout_masks=`` of
:class:`qkvnp.GPTModel` and :class:`qkvnp.TransformerBlock`,
``dropout_mask=`` of the attention layers, ``mask=`` of
:class:`qkvnp.Dropout`) or an int ``rng`` (a fresh Generator per forward)
draw nothing from the layer and pass the guard as they are.
"""
import time

import numpy as np

from .._checks import is_real_number

__all__ = ["dropout_sites", "guarded_evaluate", "check_repeat", "DropoutActiveError"]


class DropoutActiveError(ValueError):
    """A checked forward draws new random numbers on each call (dropout in training mode)."""


def dropout_sites(layer):
    """``["name (dropout=p)", ...]``: the layer and sub-layers in training mode with ``p > 0``.

    A layer exposes its probability as ``dropout`` (attention layers,
    :class:`qkvnp.TransformerBlock`, :class:`qkvnp.GPTModel`, the training
    models) or ``p`` (:class:`qkvnp.Dropout`); ``training`` says its mode.
    """
    named = getattr(layer, "named_layers", None)
    layers = [("the layer", layer)] + (list(named()) if callable(named) else [])
    sites = []
    for name, sub in layers:
        if not getattr(sub, "training", False):
            continue
        for attribute in ("dropout", "p"):
            value = getattr(sub, attribute, None)
            if is_real_number(value) and float(value) > 0:
                sites.append(f"{name} ({type(sub).__name__}, {attribute}={float(value):g})")
                break
    return sites


def _generators(layer, forward_kwargs):
    """Every Generator a forward may draw from: the layer's, and those passed to it."""
    found = []
    generators = getattr(layer, "generators", None)
    if callable(generators):
        found.extend(generators().values())
    found.extend(value for value in forward_kwargs.values()
                 if isinstance(value, np.random.Generator))
    unique = {id(generator): generator for generator in found}
    return list(unique.values())


def _refusal(layer, why):
    sites = dropout_sites(layer)
    shown = ", ".join(sites[:3]) + (f" and {len(sites) - 3} more" if len(sites) > 3 else "")
    where = ("dropout is active in training mode in " + shown if sites
             else "the forward is random (no sub-layer says it has dropout)")
    return DropoutActiveError(
        f"check_layer needs a forward that is a function of its inputs and parameters, but "
        f"{why}: {where}, so each forward of the check draws new dropout masks and the "
        f"numerical gradients would measure the change of mask. Call model.eval() (layer.eval()) "
        f"to check without dropout, or pass replay_dropout=True to check training mode with "
        f"the same masks at every forward (or give fixed masks: GPTModel's and "
        f"TransformerBlock's dropout_masks=, the attention layers' dropout_mask=, Dropout's "
        f"mask=)")


def guarded_evaluate(layer, forward, forward_kwargs, replay_dropout):
    """``forward`` refused if it draws random numbers, or replaying them.

    Parameters
    ----------
    layer : Layer
        The checked copy (its ``generators()`` and sub-layers' modes).
    forward : callable
        ``forward() -> output`` at the current values of the checked tensors.
    forward_kwargs : dict
        The forward's keyword arguments (a Generator among them is watched).
    replay_dropout : bool
        Reset every Generator to its state before the first forward, before
        each forward (see the module docstring).

    Returns
    -------
    callable
        ``evaluate() -> output``; its attributes ``last`` and ``seconds``
        hold the output and the time of its latest call (for
        :func:`check_repeat` and the estimate).

    Raises
    ------
    DropoutActiveError (a ValueError)
        From the returned callable's first call, without ``replay_dropout``,
        if the forward drew from a Generator.
    """
    generators = _generators(layer, forward_kwargs)
    saved = [generator.bit_generator.state for generator in generators]
    calls = [0]

    def timed():
        start = time.perf_counter()
        out = forward()
        evaluate.seconds = time.perf_counter() - start
        return out

    def replay():
        for generator, state in zip(generators, saved):
            generator.bit_generator.state = state

    def evaluate():
        if replay_dropout:
            replay()
            try:
                out = timed()
            finally:  # NOTE: between forwards too, so that a copy of the layer replays them
                replay()
            evaluate.last = out
            return out
        out = timed()
        calls[0] += 1
        if calls[0] == 1 and not replay_dropout and any(
                generator.bit_generator.state != state
                for generator, state in zip(generators, saved)):
            raise _refusal(layer, "a forward drew random numbers")
        evaluate.last = out
        return out

    evaluate.last, evaluate.seconds = None, 0.0
    return evaluate


def check_repeat(layer, first, again):
    """Refuse a forward whose output at one point changed between two calls.

    ``first`` is a copy of the first output, ``again`` the output of a later
    forward at the same point. A deterministic forward repeats itself to
    round-off (a path may sum in another order); dropout changes entries by
    their whole size.

    Raises
    ------
    DropoutActiveError (a ValueError)
    """
    first = np.asarray(first)
    again = np.asarray(again)
    scale = max(1.0, float(np.abs(first).max(initial=0.0)))
    if again.shape != first.shape or float(np.abs(again - first).max(initial=0.0)) > 1e-6 * scale:
        raise _refusal(layer, "two forwards at the same point gave different outputs")
