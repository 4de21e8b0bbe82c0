"""Batched sampling for RL rollouts: :func:`rollout` samples ``num_generations`` completions of
each of a batch of prompts of different lengths with the KV cache, in one compiled loop, and
returns them with their log-probabilities as :class:`Rollouts`.

The prompts are right-padded into one batch and the cache keeps a length a row
(:func:`jaxfuse.models.decoding.decode` with ``lengths``): row ``r``'s prompt fills positions
``[0, L_r)``, its first token is sampled from the logits at ``L_r - 1``, and each later token
goes at the row's own next position and attends over the row's own keys only. Prompt ``i``'s
generations are rows ``i * G .. i * G + G - 1`` (TRL's layout).

Sampling follows Hugging Face's logits processors, in their order: temperature, top-k, top-p
(:func:`process_logits`); ``temperature=0`` takes the argmax. Step ``s`` draws with
``jax.random.fold_in(key, s)``: a rollout is reproducible from its key. A row stops after it
emits an EOS id; the loop ends when every row has stopped or after ``max_new_tokens``.

Example:
  >>> import jax
  >>> from flax import nnx
  >>> from jaxfuse.models import Decoder, DecoderConfig
  >>> cfg = DecoderConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, mlp_dim=32)
  >>> model = Decoder(cfg, rngs=nnx.Rngs(0))
  >>> out = rollout(model, [[1, 2, 3], [4, 5]], num_generations=2, max_new_tokens=4,
  ...               key=jax.random.key(0))
  >>> out.completion_ids.shape, out.prompt_lengths.tolist()
  ((4, 4), [3, 3, 2, 2])
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxfuse.models import decoding


@dataclasses.dataclass(frozen=True)
class Rollouts:
  """Sampled completions, ``n = num_prompts * num_generations`` rows (prompt ``i``'s
  generations are rows ``i * G .. i * G + G - 1``), as numpy arrays.

  Attributes:
    prompt_ids: ``[n, P]`` the prompts, right-padded with the pad id.
    prompt_lengths: ``[n]``.
    completion_ids: ``[n, max_new_tokens]``: the pad id after each completion's end.
    completion_lengths: ``[n]``: the tokens up to and including the EOS (or the stop string's
      last token: :func:`truncate_at_stop_strings`).
    completion_mask: ``[n, max_new_tokens]`` bool: the first ``completion_lengths`` tokens.
    logps: ``[n, max_new_tokens]`` float32 ``log_softmax(logits / temperature)`` at each
      completion token (temperature 1 when it is 0; 0 past the end): the policy's
      log-probability that a policy-gradient loss needs, top-k and top-p left out.
    sampling_logps: ``[n, max_new_tokens]`` float32 log-probability of each token under the
      distribution it was drawn from: ``log_softmax`` of the processed logits (temperature,
      then top-k, then top-p; see :func:`process_logits`); 0 past the end.
    finished: ``[n]`` bool: the completion ended with an EOS id (or a stop string), rather than
      at ``max_new_tokens``.
    num_generations: the completions of each prompt.
    seconds: the wall time of the sampling, compilation left out.
  """
  prompt_ids: np.ndarray
  prompt_lengths: np.ndarray
  completion_ids: np.ndarray
  completion_lengths: np.ndarray
  completion_mask: np.ndarray
  logps: np.ndarray
  sampling_logps: np.ndarray
  finished: np.ndarray
  num_generations: int
  seconds: float

  @property
  def tokens_per_second(self) -> float:
    """The counted completion tokens per second of :attr:`seconds`."""
    return float(self.completion_lengths.sum()) / max(self.seconds, 1e-9)


class _Options(NamedTuple):
  max_new_tokens: int
  temperature: float
  top_k: int
  top_p: float
  eos_token_ids: tuple[int, ...]
  pad_token_id: int


def process_logits(logits: jax.Array, *, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0) -> jax.Array:
  """Float32 ``logits [..., V]`` processed as Hugging Face's logits processors do, in their
  order: divided by ``temperature`` (not when it is 0), then all but the ``top_k`` largest set to
  ``-inf`` (0: off; ties with the k-th kept), then all but the nucleus: the smallest set whose
  probability reaches ``top_p`` (1.0: off; the most likely token always kept, ties with the
  smallest kept logit kept).

  Example:
    >>> import jax.numpy as jnp
    >>> logits = jnp.log(jnp.array([0.5, 0.3, 0.2]))
    >>> jnp.isinf(process_logits(logits, top_p=0.7)).tolist()   # 0.5 + 0.3 reach 0.7
    [False, False, True]
    >>> jnp.isinf(process_logits(logits, top_k=1)).tolist()
    [False, True, True]
  """
  logits = logits.astype(jnp.float32)
  if temperature not in (0, 1):
    logits = logits / temperature
  if top_k:
    kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1:
    ascending = jnp.sort(logits, axis=-1)
    below = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1) <= 1 - top_p
    removed = jnp.minimum(jnp.sum(below, axis=-1, keepdims=True), logits.shape[-1] - 1)
    smallest_kept = jnp.take_along_axis(ascending, removed, axis=-1)
    logits = jnp.where(logits < smallest_kept, -jnp.inf, logits)
  return logits


def _token_logp(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """``log_softmax(logits)`` at ``tokens``."""
  return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]


def _sample(logits: jax.Array, key: jax.Array, opts: _Options):
  """The next tokens ``[n]``, their log-probabilities under the temperature alone and under the
  processed logits they were drawn from."""
  temperature = opts.temperature or 1.0
  processed = process_logits(logits, temperature=temperature, top_k=opts.top_k,
                             top_p=opts.top_p)
  if opts.temperature == 0:
    tokens = jnp.argmax(logits, axis=-1)
  else:
    tokens = jax.random.categorical(key, processed, axis=-1)
  tokens = tokens.astype(jnp.int32)
  return tokens, _token_logp(logits / temperature, tokens), _token_logp(processed, tokens)


def _sampling_loop(graphdef, opts: _Options, state, prompt_ids, prompt_lengths, key) -> dict:
  """The whole rollout: the prefill of the right-padded prompts, then one token a step for
  every row until each has emitted an EOS id or ``max_new_tokens`` are out."""
  model = nnx.merge(graphdef, state)
  n, width = prompt_ids.shape
  steps, pad = opts.max_new_tokens, opts.pad_token_id
  eos = jnp.asarray(opts.eos_token_ids, jnp.int32)
  logits, cache = model.decode(prompt_ids, model.init_cache(n, width + steps),
                               lengths=prompt_lengths)
  zeros = jnp.zeros((n, steps), jnp.float32)
  carry = dict(step=jnp.zeros((), jnp.int32), logits=logits, cache=cache,
               ids=jnp.full((n, steps), pad, jnp.int32), logps=zeros, sampling_logps=zeros,
               lengths=jnp.zeros((n,), jnp.int32), finished=jnp.zeros((n,), bool))

  def more(c):
    return (c["step"] < steps) & ~jnp.all(c["finished"])

  def step(c):
    i = c["step"]
    tokens, logp, sampling_logp = _sample(c["logits"], jax.random.fold_in(key, i), opts)
    live = ~c["finished"]   # rows that finished run on, fixed shapes, but nothing is counted
    tokens = jnp.where(live, tokens, pad)

    def put(out, value):
      return jax.lax.dynamic_update_slice_in_dim(out, value[:, None].astype(out.dtype), i, 1)

    out = dict(step=i + 1, ids=put(c["ids"], tokens),
               logps=put(c["logps"], jnp.where(live, logp, 0.0)),
               sampling_logps=put(c["sampling_logps"], jnp.where(live, sampling_logp, 0.0)),
               lengths=c["lengths"] + live,
               finished=c["finished"] | (live & jnp.isin(tokens, eos)))
    out["logits"], out["cache"] = model.decode(tokens[:, None], c["cache"])
    return out

  out = jax.lax.while_loop(more, step, carry)
  return {k: out[k] for k in ("ids", "logps", "sampling_logps", "lengths", "finished")}


# {(options, state tree and shapes, batch shapes): [(graphdef, compiled loop), ...]}, the most
# recently used last (a graphdef holds dicts: it is compared, not hashed).
_COMPILED: collections.OrderedDict = collections.OrderedDict()
_COMPILED_KEEP = 32


def _compiled_loop(graphdef, opts: _Options, state, batch: int, width: int, key):
  """:func:`_sampling_loop` compiled once a model structure, its options and the shapes."""
  leaves, tree = jax.tree.flatten(state)
  shapes = (tree, tuple(_shape_of(x) for x in leaves), batch, width, _shape_of(key))
  known = _COMPILED.setdefault((opts, shapes), [])
  _COMPILED.move_to_end((opts, shapes))
  for other, compiled in known:
    if other == graphdef:
      return compiled
  ints = jax.ShapeDtypeStruct
  loop = jax.jit(functools.partial(_sampling_loop, graphdef, opts))
  compiled = loop.lower(jax.tree.unflatten(tree, shapes[1]), ints((batch, width), jnp.int32),
                        ints((batch,), jnp.int32), shapes[-1]).compile()
  known.append((graphdef, compiled))
  while len(_COMPILED) > _COMPILED_KEEP:
    _COMPILED.popitem(last=False)
  return compiled


def _shape_of(x: Any) -> jax.ShapeDtypeStruct:
  """The shape, dtype and sharding of an array."""
  return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=getattr(x, "sharding",
                                                                                 None))


def _right_padded(prompts, prompt_lengths, pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
  """The prompts ``[p, P]`` right-padded with ``pad_token_id`` and their lengths ``[p]``."""
  if prompt_lengths is not None:
    ids, lengths = np.asarray(prompts), np.asarray(prompt_lengths).astype(np.int32)
    if ids.ndim != 2 or lengths.shape != ids.shape[:1]:
      raise ValueError(f"rollout: with prompt_lengths, prompts must be [p, P] and the lengths "
                       f"[p]; got {ids.shape} and {lengths.shape}")
    if np.any(lengths > ids.shape[1]):
      raise ValueError(f"rollout: prompt_lengths exceed the prompts' width {ids.shape[1]}")
    rows = [ids[i, :n] for i, n in enumerate(lengths)]
  else:
    rows = [np.asarray(p) for p in prompts]
  if not rows:
    raise ValueError("rollout: no prompts")
  for i, row in enumerate(rows):
    if row.ndim != 1 or row.size == 0 or not np.issubdtype(row.dtype, np.integer):
      raise ValueError(f"rollout: prompt {i} must be a non-empty sequence of token ids, got "
                       f"{row.tolist()!r}")
  lengths = np.array([len(r) for r in rows], np.int32)
  ids = np.full((len(rows), lengths.max()), pad_token_id, np.int32)
  for i, row in enumerate(rows):
    ids[i, :len(row)] = row
  return ids, lengths


def _check_options(num_generations, max_new_tokens, temperature, top_p, top_k):
  if not isinstance(num_generations, (int, np.integer)) or num_generations < 1:
    raise ValueError(f"rollout: num_generations must be an integer >= 1, got {num_generations!r}")
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise ValueError(f"rollout: max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
  if not temperature >= 0:
    raise ValueError(f"rollout: temperature must be >= 0 (0: greedy), got {temperature!r}")
  if not 0 < top_p <= 1:
    raise ValueError(f"rollout: top_p must be in (0, 1] (1: off), got {top_p!r}")
  if not isinstance(top_k, (int, np.integer)) or top_k < 0:
    raise ValueError(f"rollout: top_k must be an integer >= 0 (0: off), got {top_k!r}")


def rollout(model, prompts: Sequence[Sequence[int]] | np.ndarray, *, num_generations: int,
            max_new_tokens: int, key: jax.Array, temperature: float = 1.0, top_p: float = 1.0,
            top_k: int = 0, eos_token_ids: int | Iterable[int] = (), pad_token_id: int = 0,
            prompt_lengths: Sequence[int] | np.ndarray | None = None) -> Rollouts:
  """Samples ``num_generations`` completions of up to ``max_new_tokens`` tokens of each prompt
  with a :class:`jaxfuse.models.Decoder` ``model``; see the module docstring.

  Args:
    model: the policy.
    prompts: token ids, one sequence (list, numpy or jax array) a prompt, of any lengths; or,
      with ``prompt_lengths``, an array ``[p, P]`` of right-padded prompts.
    num_generations: the completions of each prompt (``G``): prompt ``i``'s are rows
      ``i * G .. i * G + G - 1``.
    max_new_tokens: the longest completion.
    key: the random key; step ``s`` samples with ``jax.random.fold_in(key, s)``.
    temperature: divides the logits; 0 takes the argmax (greedy).
    top_p: nucleus sampling: only the most likely tokens whose probability reaches ``top_p``
      (1.0: off).
    top_k: only the ``top_k`` most likely tokens (0: off).
    eos_token_ids: an id or ids that end a completion; it counts the EOS, then holds pads.
    pad_token_id: fills the prompts' padding and the completions after their end.
    prompt_lengths: ``[p]`` the real tokens of each row of ``prompts`` when it is an array.

  Returns:
    :class:`Rollouts`. The loop is compiled once a model, shapes and options; later calls with
    the same reuse it (pad the prompts to one width to share it across batches).

  Raises:
    ValueError: for ``num_generations < 1``, ``max_new_tokens < 1``, ``temperature < 0``,
      ``top_p`` outside ``(0, 1]``, ``top_k < 0``, no or an empty prompt, or prompts longer than
      the model's ``max_seq_len`` minus ``max_new_tokens``.
  """
  _check_options(num_generations, max_new_tokens, temperature, top_p, top_k)
  if isinstance(eos_token_ids, (int, np.integer)):
    eos_token_ids = (eos_token_ids,)
  opts = _Options(int(max_new_tokens), float(temperature), int(top_k), float(top_p),
                  tuple(int(e) for e in eos_token_ids), int(pad_token_id))
  ids, lengths = _right_padded(prompts, prompt_lengths, opts.pad_token_id)
  cfg = model.cfg
  longest = int(lengths.max())
  if longest + max_new_tokens > cfg.max_seq_len:
    raise ValueError(f"rollout: a prompt of {longest} tokens is longer than the model's "
                     f"max_seq_len ({cfg.max_seq_len}) minus max_new_tokens ({max_new_tokens})")
  recompute = decoding.recompute_position(cfg)
  if recompute is not None and longest + max_new_tokens > recompute:
    raise ValueError(f"rollout: sequences past {recompute} tokens would need the longrope "
                     f"re-encoding that generate does; got up to {longest + max_new_tokens}")
  ids, lengths = np.repeat(ids, num_generations, 0), np.repeat(lengths, num_generations, 0)
  graphdef, state = nnx.split(model)
  run = _compiled_loop(graphdef, opts, state, ids.shape[0], ids.shape[1], key)
  start = time.perf_counter()
  out = jax.device_get(run(state, ids, lengths, key))
  seconds = time.perf_counter() - start
  mask = np.arange(max_new_tokens) < out["lengths"][:, None]
  return Rollouts(prompt_ids=ids, prompt_lengths=lengths, completion_ids=out["ids"],
                  completion_lengths=out["lengths"], completion_mask=mask, logps=out["logps"],
                  sampling_logps=out["sampling_logps"], finished=out["finished"],
                  num_generations=int(num_generations), seconds=seconds)


def truncate_at_stop_strings(rollouts: Rollouts, tokenizer, stop_strings: Iterable[str],
                             ) -> Rollouts:
  """``rollouts`` with each completion cut after its first token whose decoded prefix
  (``tokenizer.decode`` of the completion's tokens up to it) contains one of ``stop_strings``:
  its length and mask end there, its ``logps`` and ``sampling_logps`` are 0 after it, and it
  counts as finished. The tokens after it were generated, and stay in ``completion_ids``, but
  are not counted.

  Example:
    >>> class Chars:   # a tokenizer of one character a token
    ...   def decode(self, ids):
    ...     return "".join(map(chr, ids))
    >>> z = np.zeros((1, 4), np.float32)
    >>> r = Rollouts(np.array([[65]]), np.array([1]), np.array([[104, 105, 33, 33]]),
    ...              np.array([4]), np.ones((1, 4), bool), z, z, np.array([False]), 1, 1.0)
    >>> truncate_at_stop_strings(r, Chars(), ["i!"]).completion_lengths.tolist()
    [3]
  """
  stop_strings = [s for s in stop_strings if s]
  lengths = rollouts.completion_lengths.copy()
  finished = rollouts.finished.copy()
  for row, (ids, length) in enumerate(zip(rollouts.completion_ids, lengths)):
    ids = [int(t) for t in ids[:length]]
    if not any(s in tokenizer.decode(ids) for s in stop_strings):
      continue
    for end in range(1, length + 1):
      text = tokenizer.decode(ids[:end])
      if any(s in text for s in stop_strings):
        lengths[row], finished[row] = end, True
        break
  mask = np.arange(rollouts.completion_ids.shape[1]) < lengths[:, None]
  return dataclasses.replace(rollouts, completion_lengths=lengths, completion_mask=mask,
                             logps=np.where(mask, rollouts.logps, 0.0).astype(np.float32),
                             sampling_logps=np.where(mask, rollouts.sampling_logps,
                                                     0.0).astype(np.float32),
                             finished=finished)


__all__ = ["Rollouts", "process_logits", "rollout", "truncate_at_stop_strings"]
