"""Causal attention through JAX's Pallas TPU splash-attention kernel
(jax.experimental.pallas.ops.tpu.splash_attention): a flash-attention kernel that never forms
the [L, L] probabilities in memory (the backward pass recomputes them from the saved
log-sum-exp) and skips the blocks above the causal diagonal.

The kernel is written for one device: it must see whole [H, L, K] blocks, so callers run it on
local shards (manual mode, inside shard_map; auto mode wraps it in its own shard_map, see
engine/parallel/auto.py) and never let the compiler partition it.

Shape suffixes: B batch, L length, H heads, K head_dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax._src import config as jax_config  # _check_vma: see _typed_like_inputs.
from jax.extend import core as jax_core
from jax.experimental.pallas.ops.tpu import splash_attention as splash_lib
# The kernel's own backward passes, called with a block's log-sum-exp cotangent folded in
# (block_attention); private in jax 0.10, hence pinned by tests/parity/test_splash.py.
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernels

from engine.models.varying_axes import vary, vary_alike, varying

# The kernel's tiles are multiples of 128 positions (TPU lanes); the largest of these that
# divides the length is used for every block of the forward and backward passes.
BLOCK_CHOICES = (512, 256, 128)


def block_size(length: int) -> int | None:
  """The tile size (positions) for a sequence of `length`; None: the kernel cannot take it."""
  return next((b for b in BLOCK_CHOICES if length % b == 0), None)


@functools.lru_cache(maxsize=None)
def _kernel(num_heads: int, length: int, interpret: bool, causal: bool = True,
            save_residuals: bool = False):
  """The kernel on [H, length, K] queries and keys: a causal mask, or (causal=False) a full
  one; save_residuals: it also returns the log-sum-exp of each query's logits (not
  differentiable then: block_attention below adds the backward pass)."""
  block = block_size(length)
  if block is None:  # engine/validation/attention.py refuses such lengths first.
    raise ValueError(f'splash attention needs a length divisible by 128, not {length}')
  shape = splash_lib.CausalMask if causal else splash_lib.FullMask
  mask = splash_lib.MultiHeadMask([shape((length, length))] * num_heads)
  sizes = splash_lib.BlockSizes(
      block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
      block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  with jax.ensure_compile_time_eval():  # Concrete mask tables, not tracers of one trace.
    return splash_lib.make_splash_mha_single_device(
        mask, block_sizes=sizes, save_residuals=save_residuals, interpret=interpret)


def _unchecked(f, *args):
  """f(*args) (a list of arrays) traced on the args' shapes alone and run with the
  varying-axes checks off."""
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
  with jax_config._check_vma(False):  # pylint: disable=protected-access
    return jax_core.jaxpr_as_fun(jax.make_jaxpr(f)(*shapes))(*args)


def _vjp_of(fn, shapes):
  """(the vjp of fn at arguments of `shapes` as a function of (cotangent, *residuals), the
  forward pass as a function of the arguments returning [output, *residuals])."""
  def forward(*args):
    out, vjp = jax.vjp(fn, *args)
    backward, residuals = jax.closure_convert(vjp, out)
    forward.backward = backward  # The same for every trace at these shapes.
    return [out, *residuals]
  with jax_config._check_vma(False):  # pylint: disable=protected-access
    jax.make_jaxpr(forward)(*shapes)  # Traced only, to find the backward function.
  return forward.backward, forward


def _typed_like_inputs(fn):
  """fn(q, k, v, *ids) run with shard_map's varying-axes checks off, its output and gradients
  typed as varying like its inputs (`ids`: integer inputs without gradients, the segment ids).
  jax 0.10's splash kernel builds its pallas_call outputs without those types, which a checked
  shard_map (manual mode) refuses. Typing the output with a plain pcast would be wrong: its
  transpose sums the cotangent over the devices. Inside a custom_vjp the casts are never
  transposed: each device's gradient stays its own."""

  shapes = []  # Of the inputs: set by the forward pass for the backward (no residual).

  @jax.custom_vjp
  def call(*args):
    return forward(*args)[0]

  def forward(*args):
    shapes[:] = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
    if len(args) > 3:  # Segment ids: see backward.
      return vary(_unchecked(lambda *a: [fn(*a)], *args)[0], varying(args[0])), list(args)
    out, *residuals = _unchecked(_vjp_of(fn, shapes)[1], *args)
    return vary(out, varying(args[0])), residuals

  def backward(residuals, ct):
    if len(shapes) > 3:
      # jax.closure_convert hoists only the residuals that can carry a tangent, so the kernel's
      # integer segment ids would leak from the forward trace: the backward pass runs the
      # forward kernel again instead (one more kernel call).
      grads = _unchecked(lambda c, *a: list(jax.vjp(fn, *a)[1](c)[:3]), ct, *residuals)
    else:
      grads = _unchecked(lambda *a: list(_vjp_of(fn, shapes)[0](*a)), ct, *residuals)
    # The segment ids are integers: no cotangent.
    return (*(vary(g, varying(ct)) for g in grads), *[None] * (len(shapes) - 3))

  call.defvjp(forward, backward)

  def typed(*args):
    return call(*vary_alike(*args))

  return typed


def causal_attention(q_BLHK, k_BLNK, v_BLNK, segments_BL=None):
  """softmax(q k^T + causal mask) v, the scale already on the queries (the kernel has none);
  keys and values of N heads, N dividing the H query heads. The softmax runs in float32.
  `segments_BL`: each position's document (packed documents): the kernel's SegmentIds then keep
  every query to the keys of its own document."""
  _, length, heads, _ = q_BLHK.shape
  args = list(_heads_first(q_BLHK, k_BLNK, v_BLNK))

  def kernel(interpret):
    plain = _kernel(heads, length, interpret)
    if segments_BL is None:
      return plain
    return lambda q, k, v, ids: plain(q, k, v, segment_ids=splash_lib.SegmentIds(ids, ids))

  if segments_BL is not None:
    args.append(segments_BL.astype(jnp.int32))
  run = lambda interpret: _typed_like_inputs(jax.vmap(kernel(interpret)))(*args)
  # Chosen when lowering, by the platform compiled for: on CPU (the tests) the Pallas kernel
  # runs in interpret mode, the same kernel body evaluated by XLA, slowly; a TPU compile (also
  # ahead of time from a CPU host, engine.plan) gets the real kernel.
  out_BHLK = jax.lax.platform_dependent(tpu=lambda: run(False), default=lambda: run(True))
  return out_BHLK.transpose(0, 2, 1, 3)


def _heads_first(q_BLHK, k_BLNK, v_BLNK):
  """[B, H, L, K] queries, [B, N, L, K] keys and values: the kernel's layout. Grouped heads stay
  N: the multi-head kernel reads key / value head h // (H / N) for query head h (the models'
  convention) and sums their gradients over the H / N query heads, never repeating them."""
  return tuple(x.transpose(0, 2, 1, 3) for x in (q_BLHK, k_BLNK, v_BLNK))


def _block_backward(kernel, q, k, v, ids, o, lse, do, dlse):
  """dq, dk, dv [H, L, K] of one block from the kernel's dk / dv and dq passes. They compute
  dlogits = P * (dP - di), P = exp(logits - lse), di = rowsum(do * o); the cotangent of the
  log-sum-exp adds P * dlse (d lse / d logits = P), so it enters as di - dlse. `ids`: the
  block's SegmentIds (queries', keys'), or None."""
  sizes, options = kernel.kwargs['block_sizes'], kernel.kwargs
  di = jnp.einsum('hsd,hsd->hs', o.astype(jnp.float32), do.astype(jnp.float32)) - dlse
  common = dict(is_mqa=False, mask_value=options['mask_value'], attn_logits_soft_cap=None,
                q_layout=sizes.q_layout, k_layout=sizes.k_layout, v_layout=sizes.v_layout,
                mask_function=options['mask_function'], interpret=options['interpret'])
  flat = lambda info: info._replace(partial_mask_blocks=info.partial_mask_blocks.reshape(
      -1, *info.partial_mask_blocks.shape[-2:])) if info.partial_mask_blocks is not None else info
  _, dk, dv = kernels._splash_attention_bwd_dkv(  # pylint: disable=protected-access
      q, k, v, ids, None, lse, do, di, bq=sizes.block_q_dkv, bkv=sizes.block_kv_dkv,
      bkv_compute=sizes.block_kv_dkv_compute, mask_info=flat(kernel.dkv_mask_info),
      use_fused_bwd_kernel=False, **common)
  dq = kernels._splash_attention_bwd_dq(  # pylint: disable=protected-access
      q, k, v, ids, None, lse, do, di, bq=sizes.block_q_dq, bkv=sizes.block_kv_dq,
      mask_info=flat(kernel.dq_mask_info), **common)
  return [dq, dk, dv]


@functools.lru_cache(maxsize=None)
def _block_call(heads: int, length: int, causal: bool, interpret: bool, segmented: bool = False):
  """(o, lse) of [B, H, L, K] q, k, v through the kernel, differentiable in both: a custom_vjp
  whose backward runs the kernel's backward passes with lse's cotangent (_block_backward). As
  in _typed_like_inputs, the kernel runs unchecked and its results are typed varying like q.
  segmented: two more arguments, the queries' and the keys' segment ids [B, L] (int32, no
  cotangent)."""
  kernel = _kernel(heads, length, interpret, causal, save_residuals=True)
  ids = lambda segments: splash_lib.SegmentIds(*segments) if segmented else None

  def one_row(q, k, v, *segments):
    o, residuals = kernel(q, k, v, segment_ids=ids(segments))
    return [o, residuals[0]]

  def one_row_backward(q, k, v, *rest):
    segments, tail = rest[:len(rest) - 4], rest[len(rest) - 4:]
    return _block_backward(kernel, q, k, v, ids(segments), *tail)

  forward, backward = jax.vmap(one_row), jax.vmap(one_row_backward)

  @jax.custom_vjp
  def call(*args):
    return run_forward(*args)[0]

  def run_forward(*args):
    o, lse = (vary(x, varying(args[0])) for x in _unchecked(forward, *args))
    return (o, lse), (*args, o, lse)

  def run_backward(residuals, cotangents):
    grads = _unchecked(backward, *residuals, *cotangents)
    # Segment ids are integers: no cotangent.
    return (*(vary(g, varying(residuals[0])) for g in grads),
            *[None] * (len(residuals) - 5))

  call.defvjp(run_forward, run_backward)
  return call


def block_attention(q_BQHK, k_BSNK, v_BSNK, causal: bool, segments=None):
  """One block of ring attention through the kernel: (output [B, Q, H, K] in the input dtype,
  log-sum-exp of each query's logits [B, H, Q] float32), Q = S, the scale already on the
  queries; causal: query i sees keys up to i, else every key. Both outputs are differentiable,
  so blocks merge with log-sum-exp weights under plain autodiff (engine/parallel/context.py).
  `segments`: (the queries' [B, Q], the keys' [B, S]) segment ids (packed documents), or None.
  A query that sees no key of the block gets the kernel's mask value (-0.7 * float32 max) plus
  log(S) as its log-sum-exp, finite, and the mean of the values as its output."""
  _, length, heads, _ = q_BQHK.shape
  args = _heads_first(q_BQHK, k_BSNK, v_BSNK)
  if segments is not None:
    args += tuple(s.astype(jnp.int32) for s in segments)
  args = tuple(vary_alike(*args))
  call = lambda interpret: _block_call(heads, length, causal, interpret, segments is not None)
  run = lambda interpret: call(interpret)(*args)
  o_BHQK, lse_BHQ = jax.lax.platform_dependent(tpu=lambda: run(False),
                                               default=lambda: run(True))
  return o_BHQK.transpose(0, 2, 1, 3), lse_BHQ.astype(jnp.float32)
