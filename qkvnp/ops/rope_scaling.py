"""RoPE frequency scaling: the inverse frequencies of linear, Llama 3's and YaRN's long contexts.

Shape key: D head dim (even); D/2 the number of rotated pairs.

:func:`rope_inverse_frequency` turns a head dim, a base and Hugging Face's
rope-scaling mapping (``config.rope_scaling`` / ``config.rope_parameters``)
into the inverse frequencies ``w_i`` (pair ``i`` at position ``m`` turns by
``m * w_i``) and the attention factor that multiplies ``cos`` and ``sin``.
:func:`qkvnp.ops.variants.rope_forward` takes both. No gradient flows into
them: they are constants of the model, so this module has no backward; the
rotation's backward is derived in ``docs/derivations_gpt.md`` ("RoPE
frequency scaling").
"""
from __future__ import annotations

import math

import numpy as np

from .._checks import check_int, is_real_number

TYPE_CHECKING = False
if TYPE_CHECKING:  # the hints' names, for type checkers only: ``import qkvnp`` costs numpy
    from collections.abc import Mapping

    from .._typing import FloatArray

__all__ = ["ROPE_SCALING_KEYS", "rope_inverse_frequency"]

#: For each supported ``rope_type``: (required keys, optional keys) of the mapping,
#: besides ``rope_type`` (or the legacy ``type``), ``rope_theta`` and
#: ``partial_rotary_factor``, which every type accepts.
ROPE_SCALING_KEYS = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")),
}
_COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def _number(scaling, key, *, positive=True, default=None):
    """``scaling[key]`` as a finite float (positive, or >= 0); ``default`` when absent or None."""
    value = scaling.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"rope scaling key {key!r} is required, expected a number, got None")
        return default
    if not is_real_number(value):
        raise TypeError(f"rope scaling key {key!r} must be a number, got {type(value).__name__} "
                        f"{value!r}")
    if not np.isfinite(value) or (value <= 0 if positive else value < 0):
        expected = "a positive finite number" if positive else "a finite number >= 0"
        raise ValueError(f"rope scaling key {key!r} must be {expected}, got {value!r}")
    return float(value)


def _rope_type(scaling, base):
    """The mapping's ``rope_type`` (or legacy ``type``) after checking every key; else raise."""
    if not hasattr(scaling, "keys") or not hasattr(scaling, "get"):
        raise TypeError(f"scaling must be None or a mapping, got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    legacy = scaling.get("type", rope_type)
    if legacy != rope_type:
        raise ValueError(f"rope scaling keys 'rope_type' and 'type' disagree: "
                         f"{rope_type!r} and {legacy!r}")
    if not isinstance(rope_type, str) or rope_type not in ROPE_SCALING_KEYS:
        raise ValueError(f"rope scaling 'rope_type' must be one of {tuple(ROPE_SCALING_KEYS)}, "
                         f"got {rope_type!r}")
    required, optional = ROPE_SCALING_KEYS[rope_type]
    unknown = sorted(str(key) for key in scaling.keys()
                     if key not in required + optional + _COMMON_KEYS)
    if unknown:
        raise ValueError(f"rope scaling of type {rope_type!r} got unknown key(s) {unknown}; "
                         f"expected {list(required + optional + _COMMON_KEYS)}")
    missing = [key for key in required if scaling.get(key) is None]
    if missing:
        raise ValueError(f"rope scaling of type {rope_type!r} misses required key(s) {missing}")
    theta = scaling.get("rope_theta")
    if theta is not None and (not is_real_number(theta) or float(theta) != base):
        raise ValueError(f"rope scaling key 'rope_theta' must equal base = {base!r} when given, "
                         f"got {theta!r}")
    partial = scaling.get("partial_rotary_factor")
    if partial is not None and (not is_real_number(partial) or partial != 1):
        raise ValueError(f"rope scaling key 'partial_rotary_factor' must be 1.0 (every entry "
                         f"rotated), got {partial!r}")
    return rope_type


def _llama3(inverse_frequency, scaling):
    """Llama 3.1's smooth interpolation between the kept high and the divided low frequencies."""
    factor = _number(scaling, "factor")
    low_freq_factor = _number(scaling, "low_freq_factor")
    high_freq_factor = _number(scaling, "high_freq_factor")
    if not high_freq_factor > low_freq_factor:
        raise ValueError(f"rope scaling key 'high_freq_factor' must be greater than "
                         f"'low_freq_factor' = {low_freq_factor!r}, got {high_freq_factor!r}")
    context = check_int(scaling["original_max_position_embeddings"],
                        "rope scaling key 'original_max_position_embeddings'", 1)
    wavelength = 2 * math.pi / inverse_frequency  # (D/2,)
    low_freq_wavelength = context / low_freq_factor  # longer waves than this: divided by factor
    high_freq_wavelength = context / high_freq_factor  # shorter waves than this: kept
    smooth = (context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inverse_frequency / factor + smooth * inverse_frequency  # (D/2,)
    return np.where(wavelength > low_freq_wavelength, inverse_frequency / factor,
                    np.where(wavelength < high_freq_wavelength, inverse_frequency, smoothed))


def _yarn_attention_factor(scaling, factor):
    """YaRN's ``attention_factor``: given, or ``0.1 ln(factor) + 1`` (DeepSeek's mscale ratio)."""
    attention_factor = scaling.get("attention_factor")
    if attention_factor is not None:
        return _number(scaling, "attention_factor")
    mscale = _number(scaling, "mscale", positive=False, default=0.0)
    mscale_all_dim = _number(scaling, "mscale_all_dim", positive=False, default=0.0)

    def magnitude(scale):  # 1 for no stretch, growing with the log of the stretch
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    # NOTE: a zero or absent mscale / mscale_all_dim falls back to factor alone, as Hugging Face does
    if mscale and mscale_all_dim:
        return magnitude(mscale) / magnitude(mscale_all_dim)
    return magnitude(1.0)


def _yarn(inverse_frequency, scaling, D, base):
    """YaRN: a linear ramp over the pairs from interpolated (divided) to extrapolated (kept)."""
    factor = _number(scaling, "factor")
    context = check_int(scaling["original_max_position_embeddings"],
                        "rope scaling key 'original_max_position_embeddings'", 1)
    beta_fast = _number(scaling, "beta_fast", default=32.0)
    beta_slow = _number(scaling, "beta_slow", default=1.0)
    if base == 1:
        raise ValueError("base must not be 1 with rope scaling 'yarn' (its ramp divides by log(base))")
    truncate = scaling.get("truncate")
    truncate = True if truncate is None else truncate
    if not isinstance(truncate, (bool, np.bool_)):
        raise TypeError(f"rope scaling key 'truncate' must be a bool, got "
                        f"{type(truncate).__name__} {truncate!r}")

    def pair_index(rotations):  # the (fractional) pair that turns `rotations` times in `context`
        return D * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_index(beta_fast), pair_index(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001  # NOTE: a one-point ramp would divide by zero; Hugging Face widens it so
    ramp = np.clip((np.arange(D // 2, dtype=np.float64) - low) / (high - low), 0, 1)  # (D/2,)
    # pairs below `low` turn fast (many rotations in the context): kept; above `high`: divided
    extrapolated = 1 - ramp
    interpolated = inverse_frequency / factor
    out = interpolated * (1 - extrapolated) + inverse_frequency * extrapolated  # (D/2,)
    return out, _yarn_attention_factor(scaling, factor)


def rope_inverse_frequency(head_dim: int, base: float = 10000.0,
                           scaling: Mapping | None = None) -> tuple[FloatArray, float]:
    """RoPE's inverse frequencies and attention factor under a rope-scaling mapping.

    Parameters
    ----------
    head_dim : int
        D, even.
    base : float
        Pair ``i`` turns by ``base**(-2i/D)`` per position before scaling
        (Hugging Face's ``rope_theta``).
    scaling : mapping, optional
        None (plain RoPE) or Hugging Face's rope-scaling mapping, with
        ``"rope_type"`` (or the legacy ``"type"``) one of:

        - ``"default"``: no scaling;
        - ``"linear"``: ``factor``;
        - ``"llama3"``: ``factor``, ``low_freq_factor``,
          ``high_freq_factor``, ``original_max_position_embeddings``;
        - ``"yarn"``: ``factor``, ``original_max_position_embeddings``;
          optional ``beta_fast`` (32), ``beta_slow`` (1),
          ``attention_factor``, ``mscale``, ``mscale_all_dim``,
          ``truncate`` (True).

        ``rope_theta`` (equal to ``base``) and ``partial_rotary_factor``
        (1.0) are accepted too; an optional key set to None is absent.

    Returns
    -------
    inverse_frequency : ndarray of float64, shape (D/2,)
        Pass it to :func:`qkvnp.functional.rope_forward`'s
        ``inverse_frequency``.
    attention_factor : float
        1.0 except for YaRN; pass it to ``rope_forward``'s
        ``attention_factor`` (it multiplies ``cos`` and ``sin``).

    Raises
    ------
    ValueError
        For an odd or non-positive ``head_dim``, a bad ``base``, an unknown
        ``rope_type`` or key, a missing required key, or a bad value (each
        named, with what was expected and what came).
    TypeError
        For a ``scaling`` that is not a mapping, or a value of the wrong type.

    Notes
    -----
    With :math:`w_i = b^{-2i/D}` and wavelength :math:`\\lambda_i = 2\\pi / w_i`:

    - linear: :math:`w_i / f`;
    - llama3 (context :math:`L`, :math:`\\lambda_{lo} = L / \\alpha_{lo}`,
      :math:`\\lambda_{hi} = L / \\alpha_{hi}`): :math:`w_i` where
      :math:`\\lambda_i < \\lambda_{hi}`, :math:`w_i / f` where
      :math:`\\lambda_i > \\lambda_{lo}`, else :math:`(1 - s) w_i / f + s w_i`
      with :math:`s = (L / \\lambda_i - \\alpha_{lo}) / (\\alpha_{hi} - \\alpha_{lo})`;
    - yarn: :math:`(1 - e_i) w_i / f + e_i w_i` with :math:`e_i` a ramp from
      1 to 0 between the pairs that turn :math:`\\beta_{fast}` and
      :math:`\\beta_{slow}` times in the context, and attention factor
      :math:`0.1 \\ln f + 1` unless given.

    Derived in ``docs/derivations_gpt.md`` ("RoPE frequency scaling").

    Examples
    --------
    >>> w, factor = rope_inverse_frequency(4, 100.0, {"rope_type": "linear", "factor": 2.0})
    >>> w.tolist(), factor
    ([0.5, 0.05], 1.0)
    """
    D = check_int(head_dim, "head_dim", 2)
    if D % 2:
        raise ValueError(f"head_dim must be even, got {D}")
    if not is_real_number(base) or not base > 0 or not np.isfinite(base):
        raise ValueError(f"base must be a positive finite number, got {base!r}")
    base = float(base)
    inverse_frequency = base ** (-np.arange(0, D, 2, dtype=np.float64) / D)  # (D/2,)
    rope_type = "default" if scaling is None else _rope_type(scaling, base)
    if rope_type == "linear":
        return inverse_frequency / _number(scaling, "factor"), 1.0
    if rope_type == "llama3":
        return _llama3(inverse_frequency, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(inverse_frequency, scaling, D, base)
    return inverse_frequency, 1.0
