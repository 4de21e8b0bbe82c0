"""Rotary position embeddings computed as Hugging Face transformers computes them.

A :class:`Rope` holds one ``rope_parameters`` dict of a transformers config (the flat dict of
one attention layer type: Gemma 3 has one per layer type) and gives the inverse frequencies
and the cos/sin tables of the "rotate half" convention (:mod:`jaxfuse.ops.rotary`), for the
rope types the decoder families use: ``default`` (Llama 2, Qwen3, Gemma 2, OLMo 2), ``linear``
(Gemma 3's global layers), ``dynamic`` (NTK), ``llama3`` (Llama 3.1 to 3.3), ``yarn`` (Qwen2.5
long context, DeepSeek, gpt-oss) and ``longrope`` (Phi-3 long context).

Numerics mirror transformers 5.x step by step, so that a checkpoint matches its torch twin:

- the static tables (every type's ``inv_freq`` at initialization, longrope's long one) are
  computed on the host in float32, operation by operation as torch does them (``1 / x`` is a
  reciprocal, ``2 * pi / x`` a reciprocal times ``float32(2 * pi)``, Python scalars rounded to
  float32), with ``base ** exponent`` correctly rounded through float64 (torch's CPU ``pow``
  is within one ulp of that and equal to it for all but about 2% of the elements);
- the angles are ``float32(position) * inv_freq``, their cos and sin are taken in float32 and
  multiplied by ``attention_scaling`` (yarn's and longrope's attention factor).

Two types depend on the sequence length: ``longrope`` takes its long factors once the sequence
is longer than ``original_max_position_embeddings``, and ``dynamic`` grows its base once it is
longer than ``max_position_embeddings`` (recomputed in float32 from the length, as torch does it
from a tensor). transformers takes that length as ``max(position_ids) + 1`` of each call;
:meth:`Rope.cos_sin` does the same unless given ``seq_len``. transformers' dynamic module also
keeps state between calls (its ``max_seq_len_cached``): :meth:`Rope.track_seq_len` is that
state's update as a pure function, for callers that must reproduce it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_F32 = np.float32


class UnsupportedRopeError(ValueError):
  """A ``rope_parameters`` dict asks for a rotary embedding that :class:`Rope` does not compute."""


# ----------------------------------------------------------------------------- float32 helpers


def _exponents(dim: int) -> np.ndarray:
  """``arange(0, dim, 2) / dim`` in float32, as torch computes it from an int64 arange."""
  return np.arange(0, dim, 2).astype(_F32) / _F32(dim)


def _pow32(base: float, exponents: np.ndarray) -> np.ndarray:
  """``float32(base) ** exponents`` in float32, correctly rounded (through float64)."""
  return (np.float64(_F32(base)) ** exponents.astype(np.float64)).astype(_F32)


def _plain_inv_freq(base: float, dim: int) -> np.ndarray:
  """RoPE's ``1 / base ** (2 i / dim)`` in float32."""
  return _F32(1) / _pow32(base, _exponents(dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 when not scaling)."""
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# ------------------------------------------------------------- one function per rope type
# Each takes the Rope and the sequence length seen (None: transformers' state at initialization)
# and returns (inv_freq float32 [head_dim // 2], attention_scaling).


def _default(rope: Rope, seq_len) -> tuple[Any, float]:
  return _plain_inv_freq(rope.theta, rope.head_dim), 1.0


def _linear(rope: Rope, seq_len) -> tuple[Any, float]:
  # Dividing the frequencies by the factor is dividing the positions by it.
  return _plain_inv_freq(rope.theta, rope.head_dim) / _F32(rope.param("factor")), 1.0


def _dynamic(rope: Rope, seq_len) -> tuple[Any, float]:
  factor, dim, m = rope.param("factor"), rope.head_dim, rope.max_position_embeddings
  # Up to max_position_embeddings transformers uses its table from initialization, whose base
  # it computes with Python floats (the correction is 1 there, up to rounding).
  base = rope.theta * ((factor * m / m) - (factor - 1)) ** (dim / (dim - 2))
  original = _plain_inv_freq(base, dim)
  if seq_len is None:
    return original, 1.0
  # Past it, transformers recomputes the base from a tensor seq_len, in float32 but for one
  # power: of a float32 scalar to the float64 exponent dim / (dim - 2). Rounding that exponent
  # to float32 moves the result by up to a few ulps; its float32 remainder puts most of it back.
  seq_len = jnp.asarray(seq_len)
  ratio = _F32(factor) * seq_len.astype(jnp.float32) / _F32(m) - _F32(factor - 1)
  exponent = dim / (dim - 2)
  power = ratio ** _F32(exponent)
  power = power + power * (_F32(exponent - float(_F32(exponent))) * jnp.log(ratio))
  grown = 1 / (_F32(rope.theta) * power) ** _exponents(dim)
  return jnp.where(seq_len > m, grown, original), 1.0


def _llama3(rope: Rope, seq_len) -> tuple[Any, float]:
  inv_freq = _plain_inv_freq(rope.theta, rope.head_dim)
  factor, low, high, context = (rope.param(k) for k in (
      "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))
  low_freq_wavelen, high_freq_wavelen = _F32(context / low), _F32(context / high)
  wavelen = (_F32(1) / inv_freq) * _F32(2 * math.pi)     # torch: 2 pi / t is 1 / t * 2 pi
  # Long wavelengths are interpolated by the factor, short ones kept, the ones between blended.
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / _F32(factor), inv_freq)
  smooth = ((_F32(1) / wavelen) * _F32(context) - _F32(low)) / _F32(high - low)
  blended = (_F32(1) - smooth) * scaled / _F32(factor) + smooth * scaled
  medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
  return np.where(medium, blended, scaled), 1.0


def _yarn(rope: Rope, seq_len) -> tuple[Any, float]:
  dim, base = rope.head_dim, rope.theta
  context = rope.param("original_max_position_embeddings")
  factor = rope.param("factor")
  if factor is None:
    factor = rope.max_position_embeddings / context
  attention = rope.param("attention_factor")
  mscale, mscale_all_dim = rope.param("mscale"), rope.param("mscale_all_dim")
  if attention is None and mscale and mscale_all_dim:
    attention = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
  elif attention is None:
    attention = _yarn_mscale(factor)

  def correction_dim(rotations):  # the dim whose wavelength fits `rotations` times in the context
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low = correction_dim(rope.param("beta_fast") or 32)
  high = correction_dim(rope.param("beta_slow") or 1)
  if rope.param("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)      # transformers bounds it by dim - 1, not dim / 2
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=_F32) - _F32(low)) / _F32(high - low), 0, 1)
  extrapolated = _F32(1) - ramp                     # how much of each dim keeps its frequency
  powers = _pow32(base, _exponents(dim))
  inv_extrapolation, inv_interpolation = _F32(1) / powers, _F32(1) / (_F32(factor) * powers)
  inv_freq = inv_interpolation * (_F32(1) - extrapolated) + inv_extrapolation * extrapolated
  return inv_freq, attention


def _longrope(rope: Rope, seq_len) -> tuple[Any, float]:
  context = rope.param("original_max_position_embeddings")
  factor = rope.param("factor")
  if factor is None:
    factor = rope.max_position_embeddings / context
  attention = rope.param("attention_factor")
  if attention is None:
    attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(context))
  powers = _pow32(rope.theta, _exponents(rope.head_dim))
  short, long = (_F32(1) / (np.asarray(rope.param(k), _F32) * powers)
                 for k in ("short_factor", "long_factor"))
  if seq_len is None:
    return short, attention
  return jnp.where(jnp.asarray(seq_len) > context, long, short), attention


class _RopeType(NamedTuple):
  compute: Callable[[Rope, Any], tuple[Any, float]]
  required: tuple[str, ...] = ()
  optional: tuple[str, ...] = ()


_ORIGINAL = "original_max_position_embeddings"
TYPES: dict[str, _RopeType] = {
    "default": _RopeType(_default),
    "linear": _RopeType(_linear, ("factor",)),
    "dynamic": _RopeType(_dynamic, ("factor",)),
    "llama3": _RopeType(_llama3, ("factor", "low_freq_factor", "high_freq_factor", _ORIGINAL)),
    "yarn": _RopeType(_yarn, ("factor", _ORIGINAL), ("attention_factor", "beta_fast",
                                                      "beta_slow", "mscale", "mscale_all_dim",
                                                      "truncate")),
    "longrope": _RopeType(_longrope, ("short_factor", "long_factor", _ORIGINAL),
                          ("attention_factor", "factor")),
}
"""The rope types :class:`Rope` computes: their function and their parameters' names."""

# The types whose parameters transformers gives the config's original_max_position_embeddings.
_TAKES_ORIGINAL = ("llama3", "yarn", "longrope")


def _refuse(field: str, problem: str) -> UnsupportedRopeError:
  return UnsupportedRopeError(f"rope_parameters: {field} {problem}")


@dataclasses.dataclass(frozen=True)
class Rope:
  """A rotary embedding: its type and parameters as transformers' ``rope_parameters`` give them.

  Attributes:
    head_dim: the rotated head dim (even): the tables have ``head_dim // 2`` columns.
    rope_type: one of :data:`TYPES`: ``default``, ``linear``, ``dynamic``, ``llama3``, ``yarn``,
      ``longrope``.
    theta: the wavelength base, ``rope_theta``.
    params: the type's other parameters, as sorted ``(key, value)`` pairs (lists as tuples).
    max_position_embeddings: the config's ``max_position_embeddings``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxfuse.blocks.rope import Rope
    >>> rope = Rope.from_hf({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
    ...                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    ...                      "original_max_position_embeddings": 8192},
    ...                     head_dim=64, max_position_embeddings=131072)
    >>> cos, sin = rope.cos_sin(jnp.arange(6))
    >>> cos.shape, sin.dtype, rope.attention_scaling
    ((6, 32), dtype('float32'), 1.0)
    >>> Rope.from_hf(rope.to_hf(), head_dim=64, max_position_embeddings=131072) == rope
    True
  """

  head_dim: int
  rope_type: str = "default"
  theta: float = 10000.0
  params: tuple = ()
  max_position_embeddings: int = 2048

  def __post_init__(self):
    kind = TYPES.get(self.rope_type)
    if kind is None:
      raise _refuse("rope_type", f"{self.rope_type!r} is not supported; supported: "
                    f"{', '.join(TYPES)}")
    if not (isinstance(self.head_dim, int) and self.head_dim > 0 and self.head_dim % 2 == 0):
      raise _refuse("head_dim", f"must be a positive even int, got {self.head_dim!r}")
    if not self.theta > 0:
      raise _refuse("rope_theta", f"must be > 0, got {self.theta!r}")
    names = [k for k, _ in self.params]
    for name in names:
      if name not in kind.required + kind.optional:
        raise _refuse(repr(name), f"is not a parameter of rope_type {self.rope_type!r}; it takes "
                      f"{', '.join(kind.required + kind.optional) or 'only rope_theta'}")
    for name in kind.required:
      if name not in names:
        raise _refuse(repr(name), f"is missing: rope_type {self.rope_type!r} requires "
                      f"{', '.join(kind.required)}")
      if self.param(name) is None and (self.rope_type, name) != ("yarn", "factor"):
        raise _refuse(repr(name), f"must be set for rope_type {self.rope_type!r}, got None")
    for name in ("short_factor", "long_factor"):
      value = self.param(name)
      if value is not None and len(value) != self.head_dim // 2:
        raise _refuse(name, f"must have head_dim // 2 = {self.head_dim // 2} values, got "
                      f"{len(value)}")

  @classmethod
  def from_hf(cls, rope_parameters: Mapping | None, *, head_dim: int,
              max_position_embeddings: int, original_max_position_embeddings: int | None = None,
              theta: float | None = None) -> Rope:
    """Reads a transformers ``rope_parameters`` (or legacy ``rope_scaling``) dict.

    As transformers standardizes it: ``type`` stands for ``rope_type`` (which wins when both are
    there), and llama3, yarn and longrope take their ``original_max_position_embeddings`` from
    the config's field of that name when it has one (Phi-3's does), else from the dict, else
    ``max_position_embeddings``. Phi-3's config renames its legacy types ``su`` and ``yarn`` to
    ``longrope`` before this point: a Phi-3 loader must do the same.

    Args:
      rope_parameters: the flat dict of one layer type (``None`` or empty: the default rope).
      head_dim: the attention head dim.
      max_position_embeddings: the config's ``max_position_embeddings``.
      original_max_position_embeddings: the config's top-level field of that name, if any.
      theta: the config's legacy top-level ``rope_theta``, used when the dict has none.

    Returns:
      The :class:`Rope`.

    Raises:
      UnsupportedRopeError: an unknown rope type, an unknown or missing parameter, a
        ``partial_rotary_factor`` other than 1, no ``rope_theta`` anywhere; the message names
        the field and what is supported.
    """
    params = dict(rope_parameters or {})
    legacy_type = params.pop("type", "default")
    rope_type = params.pop("rope_type", legacy_type)
    if rope_type not in TYPES:
      raise _refuse("rope_type", f"{rope_type!r} is not supported; supported: {', '.join(TYPES)}")
    theta = params.pop("rope_theta", theta)
    if theta is None:
      raise _refuse("rope_theta", "is missing: give it in rope_parameters or as theta= (each "
                    "model family has its own default)")
    partial = params.pop("partial_rotary_factor", 1.0)
    if partial != 1.0:
      raise _refuse("partial_rotary_factor", f"{partial!r} is not supported: only 1.0 is "
                    "supported (every head dim rotated)")
    if rope_type in _TAKES_ORIGINAL:
      if original_max_position_embeddings is not None:
        params[_ORIGINAL] = original_max_position_embeddings
      params.setdefault(_ORIGINAL, max_position_embeddings)
    items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))
    return cls(head_dim=head_dim, rope_type=rope_type, theta=float(theta), params=items,
               max_position_embeddings=max_position_embeddings)

  def to_hf(self) -> dict:
    """The ``rope_parameters`` dict transformers writes back (tuples as lists)."""
    out = {"rope_type": self.rope_type, "rope_theta": self.theta}
    out.update((k, list(v) if isinstance(v, tuple) else v) for k, v in self.params)
    return out

  def param(self, name: str, default: Any = None) -> Any:
    """One of :attr:`params` (``default`` when absent, as ``dict.get``)."""
    return dict(self.params).get(name, default)

  @property
  def attention_scaling(self) -> float:
    """What transformers multiplies cos and sin by: yarn's and longrope's attention factor."""
    return float(TYPES[self.rope_type].compute(self, None)[1])

  def inv_freq(self, seq_len: int | jax.Array | None = None) -> jax.Array:
    """The inverse frequencies, float32 ``[head_dim // 2]``.

    Args:
      seq_len: the sequence length seen (``dynamic`` and ``longrope`` depend on it; may be a
        traced value); ``None``: transformers' table at initialization.

    Returns:
      ``inv_freq``: the angle of position ``p`` in pair ``i`` is ``p * inv_freq[i]``.
    """
    return jnp.asarray(TYPES[self.rope_type].compute(self, seq_len)[0], jnp.float32)

  def track_seq_len(self, positions: jax.Array, cached: int | jax.Array | None = None):
    """The sequence length transformers' rotary module computes this call's frequencies for.

    transformers' dynamic module keeps a ``max_seq_len_cached`` between calls: it grows it to
    ``max(positions) + 1`` when that is longer, resets it to ``max_position_embeddings`` when
    the call is shorter than that, and otherwise keeps using the frequencies of the cached
    length. The returned length is also its cache after the call: pass it back as ``cached``
    with the next call's positions. Other types keep no state: ``max(positions) + 1``.

    Args:
      positions: this call's integer positions, ``[seq]`` or ``[batch..., seq]``.
      cached: the previous call's result; ``None`` before the first call.

    Returns:
      An int32 scalar, to give :meth:`cos_sin` as ``seq_len``.
    """
    seq_len = jnp.max(jnp.asarray(positions)).astype(jnp.int32) + 1
    if self.rope_type != "dynamic":
      return seq_len
    m = self.max_position_embeddings
    cached = jnp.asarray(m if cached is None else cached, jnp.int32)
    return jnp.where(seq_len > cached, seq_len, jnp.where((seq_len < m) & (cached > m), m, cached))

  def cos_sin(self, positions: jax.Array, *,
              seq_len: int | jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The cos and sin tables of some positions, ``attention_scaling`` applied.

    Args:
      positions: integer positions, ``[seq]`` or ``[batch..., seq]``.
      seq_len: the sequence length the frequencies are for (``dynamic`` and ``longrope``);
        ``None``: ``max(positions) + 1``, as transformers takes it in each call.

    Returns:
      ``(cos, sin)``, float32 ``[..., seq, head_dim // 2]``: the halves (transformers repeats
      them to ``head_dim``); a pair ``(x1, x2)`` of halves rotates to
      ``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``.
    """
    positions = jnp.asarray(positions)
    if seq_len is None and self.rope_type in ("dynamic", "longrope"):
      seq_len = jnp.max(positions).astype(jnp.int32) + 1
    inv_freq, scaling = TYPES[self.rope_type].compute(self, seq_len)
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
    scaling = jnp.float32(scaling)
    return jnp.cos(angles) * scaling, jnp.sin(angles) * scaling
