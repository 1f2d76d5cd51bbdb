"""Generation's layout: the ops that run the training code's model one token at a time through a
key/value cache, and the compiled prefill and decode steps on the setup's mesh.

The cache is [layers, batch, slots, kv heads, head_dim] for keys and for values, laid out by the
run's rules like the activations (heads over `tensor` shard it too); latent attention caches each
position's latent and rotary key instead ([layers, batch, slots, C] and [..., R]). Row b's
prompt fills slots [0, n_b); each new token writes its keys and values to the slot of its
position and attends to the slots up to it. engine.generate.sampling sizes the cache, picks the
tokens and drives the steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from engine.models.attention.causal import grouped_logits, grouped_values
from engine.models.layers import layer_group, num_groups, one_layer
from engine.parallel.auto import AutoOps
from engine.state import TrainSetup

# The cache: [layers, batch, slots, kv heads, head_dim] for keys and for values ('kv_heads':
# split over `tensor` where they divide; a model without them, GPT, caches its 'heads').
CACHE_AXES = (None, 'batch', None, 'kv_heads', 'head_dim')


# Latent attention's cache: [layers, batch, slots, latent] and [layers, batch, slots, rotary].
LATENT_CACHE_AXES = (None, 'batch', None, None)


def cache_axes(setup: TrainSetup) -> tuple:
  """CACHE_AXES, with 'heads' for a model whose parameters name no 'kv_heads'."""
  if setup.model.latent_cache:
    return LATENT_CACHE_AXES
  grouped = any('kv_heads' in p.logical_axes for p in setup.parameters())
  return CACHE_AXES if grouped else CACHE_AXES[:3] + ('heads', 'head_dim')


def cache_names(setup: TrainSetup) -> tuple[str, str]:
  """The cache's two arrays: keys and values, or latent attention's latents and rotary keys."""
  return ('latent', 'rope') if setup.model.latent_cache else ('k', 'v')


class DecodeOps(AutoOps):
  """Auto mode's layout, with each row's own positions and attention through the cache."""

  def __init__(self, setup: TrainSetup, cache: dict, positions_BL: jax.Array):
    super().__init__(setup)
    self.cache, self.positions_BL = dict(cache), positions_BL
    self.cache_axes = cache_axes(setup)
    self._layer = 0

  def kv_for_query_heads(self, kv_BLNK, num_heads):
    # All the key / value heads, laid out as the cache: the attention groups the query heads.
    del num_heads
    return self.constrain(kv_BLNK, ('batch', 'length', 'kv_heads', 'head_dim'))

  def positions(self, length):
    del length
    return self.positions_BL

  def stack(self, run, layers, x):
    # Layer by layer in Python (not the model's scan, whose trace the cache must not leave),
    # each attending through its own slice of the cache. No remat: nothing is differentiated.
    del run
    for group in ([layers] if num_groups(layers) == 1 else
                  [layer_group(layers, r) for r in range(num_groups(layers))]):
      for index in range(jax.tree.leaves(nnx.state(group))[0].shape[0]):
        layer = self.prepare_params(one_layer(group, index), skip_stacked=False)
        x = layer(x, self)
    return x

  def _written(self, new: dict) -> list:
    """Writes each of `new` [B, L, ...] to its cache at this layer and the rows' positions;
    returns this layer's whole caches [B, S, ...] in the compute dtype. Each layer writes once,
    in the model's order (layers before the stack too), so the writes count the layers."""
    rows = jnp.arange(self.positions_BL.shape[0])[:, None]
    for name, value in new.items():
      cache = self.cache[name].at[self._layer, rows, self.positions_BL].set(
          value.astype(self.cache[name].dtype))
      self.cache[name] = self.constrain(cache, self.cache_axes)
    layer, self._layer = self._layer, self._layer + 1
    return [self.cache[name][layer].astype(value.dtype) for name, value in new.items()]

  def latent_history(self, latent_BLC, key_rope_BLR):
    return self._written({'latent': latent_BLC, 'rope': key_rope_BLR})

  def attention(self, q_BLHK, k_BLNK, v_BLNK, spec):
    # Its own computation whatever spec.implementation: one query row per step needs no kernel.
    if 'k' in self.cache:
      keys_BSNK, values_BSNK = self._written({'k': k_BLNK, 'v': v_BLNK})
    else:  # Latent attention's keys and values, from its cache: every slot already.
      keys_BSNK, values_BSNK = k_BLNK, v_BLNK
    q_BLHK, scale = spec.prescale(q_BLHK)
    logits_BHQS = spec.capped(grouped_logits(q_BLHK, keys_BSNK.astype(q_BLHK.dtype)) * scale)
    # Each query's own position against every slot's.
    visible_BQS = spec.visible(self.positions_BL[:, :, None], jnp.arange(keys_BSNK.shape[1]))
    logits_BHQS = jnp.where(visible_BQS[:, None], logits_BHQS, jnp.finfo(jnp.float32).min)
    probs_BHQS = jax.nn.softmax(logits_BHQS, axis=-1).astype(q_BLHK.dtype)
    return grouped_values(probs_BHQS, values_BSNK.astype(q_BLHK.dtype))


@dataclasses.dataclass(frozen=True)
class DecodeSteps:
  """The jitted steps of one setup (the cache as {'k', 'v'}, or latent attention's {'latent',
  'rope'}, laid out by cache_axes).

  prefill(params, tokens_BP, lengths_B, key) -> (cache, next_B): every prompt position at once
    into a new cache (right-padded prompts of lengths_B tokens); each row's next token picked
    from the logits of its last prompt token.
  decode(params, cache, tokens_B, positions_B, key) -> (cache, next_B): one token per row at its
    position; the cache is donated.
  """
  prefill: Callable
  decode: Callable


def build_decode_steps(setup: TrainSetup, empty_cache: Callable, pick: Callable) -> DecodeSteps:
  """The steps on the setup's mesh. `empty_cache(batch)`: the zero cache the prefill fills
  (traced inside it, so it is never transferred); `pick(logits_BV, key) -> next_B`: the
  sampling, compiled into both steps."""

  def model(params, ops):
    return ops.prepare_params(nnx.merge(setup.graphdef, params))

  def prefill(params, tokens_BP, lengths_B, key):
    positions_BP = jnp.broadcast_to(jnp.arange(tokens_BP.shape[1]), tokens_BP.shape)
    ops = DecodeOps(setup, empty_cache(tokens_BP.shape[0]), positions_BP)
    logits_BPV = model(params, ops)(tokens_BP, ops)
    last_BV = jnp.take_along_axis(logits_BPV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    return ops.cache, pick(last_BV, key)

  def decode(params, cache, tokens_B, positions_B, key):
    ops = DecodeOps(setup, cache, positions_B[:, None])
    logits_BV = model(params, ops)(tokens_B[:, None], ops)[:, 0]
    return ops.cache, pick(logits_BV, key)

  mesh, spec = setup.mesh, setup.rules.spec
  params = setup.state_shardings()['params']
  rows = NamedSharding(mesh, spec(('batch', None), activation=True))
  row = NamedSharding(mesh, spec(('batch',), activation=True))
  cache = NamedSharding(mesh, spec(cache_axes(setup), activation=True))
  kv = dict.fromkeys(cache_names(setup), cache)
  return DecodeSteps(
      prefill=jax.jit(prefill, in_shardings=(params, rows, row, None), out_shardings=(kv, row)),
      decode=jax.jit(decode, in_shardings=(params, kv, row, row, None), out_shardings=(kv, row),
                     donate_argnums=1))
