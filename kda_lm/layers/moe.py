r"""Bailing / DeepSeek-V3 mixture of experts with aux-loss-free balancing.

Shapes (docs/glossary.md): B batch rows, T tokens, M = B*T
tokens flat, D model width, E routed experts, A experts per token (top-k),
F expert hidden width, G groups.

  s = sigmoid(x W_router)                    [M,E] float32 router scores
  sel = s + stop_gradient(bias)              bias only steers *selection*
  (n_group > 1: keep the `topk_group` groups with the largest sum of their
   top-2 `sel`, mask the other groups' experts out)
  idx = top_k(sel, A)                        [M,A]
  w = s[idx] / sum(s[idx]) * routed_scaling_factor     [M,A] from raw scores
  y = sum_j w_j SwiGLU_{idx_j}(x) + SwiGLU_shared(x)

Dispatch is capacity-free (no token is dropped): the M*A (token, expert)
pairs are sorted by expert, the tokens gathered into that order, and every
expert's SwiGLU runs as a grouped matmul (`kda_lm.ops.gmm`, per-expert
group sizes) over its contiguous slice; the outputs are un-permuted and
summed with their weights. Compute is that of M*A expert applications
(`6*M*A*D*F` forward FLOPs for the routed experts, not `6*M*E*D*F`, plus
at most E - 1 partial row tiles per matmul); memory is `M*A*(D + 3F)`
activations for the gathered inputs and hidden states plus the `[M,E]`
scores. Under a device mesh the sort and the grouped matmuls run inside
`jax.shard_map`, each device on its own tokens
(`parallel_maps.token_map`): GSPMD can partition neither a global sort
nor a Pallas kernel.

Expert parallelism (a mesh `expert` axis of n > 1 devices,
`expert_parallel_swiglu`): each device holds E/n experts. It sorts its
own pairs by expert, which puts them in the order of the devices owning
the experts, exchanges the per-expert pair counts with every device, then
the pairs' token vectors over `expert`: on TPU and GPU with
`ragged_all_to_all`, only the real rows, packed by source into a buffer
of n*cap rows (`_ragged_exchange`); on CPU, which cannot run it, with
`all_to_all` of an [n, cap, D] buffer whose slot j holds the pairs for
device j (`_padded_exchange`). It runs its local experts as grouped
matmuls over what it received and sends the results back the same way.
By default no pair is dropped: a device sends at most `cap = M * min(A,
E/n)` pairs to one device (a token's A experts are distinct), so the
buffers always hold them; the price is that bound's memory (n times the
pairs when E/n >= A; on CPU the padding also moves). With a capacity
factor c (`capacity_factor`, logged when
traced) `cap = min(that, ceil(c * M * A / n))`: of the pairs a device
sends to one device, those past `cap` in expert order are dropped (they
add nothing to their token's output); see docs/expert_parallel.md.

The selection bias `e_score_correction_bias [E]` is a float32 parameter that
gradients never reach (`stop_gradient`); the training step moves it with
`update_selection_biases` from the observed load:
`bias += rate * sign(mean - load)` (DeepSeek-V3), raising under-loaded
experts and lowering over-loaded ones.
"""

import functools
import math
from typing import NamedTuple, Optional

from absl import logging
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from kda_lm.layers import mlp
from kda_lm.ops import gmm
from kda_lm.parallel import maps as parallel_maps

BIAS_NAME = "e_score_correction_bias"


def check_dims(*, num_experts: int, num_experts_per_tok: int,
               n_group: int = 1, topk_group: int = 1) -> None:
  """Raises ValueError for an inconsistent router shape."""
  if not 1 <= num_experts_per_tok <= num_experts:
    raise ValueError(f"need 1 <= num_experts_per_tok <= num_experts, got "
                     f"{num_experts_per_tok}, {num_experts}.")
  if n_group < 1 or num_experts % n_group:
    raise ValueError(f"n_group {n_group} must divide num_experts "
                     f"{num_experts}.")
  if not 1 <= topk_group <= n_group:
    raise ValueError(f"need 1 <= topk_group <= n_group, got {topk_group}, "
                     f"{n_group}.")
  if topk_group * (num_experts // n_group) < num_experts_per_tok:
    raise ValueError("topk_group groups hold fewer experts than "
                     "num_experts_per_tok.")


def route(scores: jax.Array, bias: jax.Array, top_k: int, *,
          n_group: int = 1, topk_group: int = 1,
          routed_scaling_factor: float = 1.0, renormalize: bool = True
          ) -> tuple[jax.Array, jax.Array]:
  """Selects experts and their combine weights.

  Args:
    scores: [...,E] float32 sigmoid router scores (any leading token dims:
      [B,T,E] keeps a batch and context sharding that flattening to [M,E]
      would lose).
    bias: [E] selection bias (selection only; no gradient flows to it).
    top_k: A.
    n_group: expert groups for group-limited selection (1 = none).
    topk_group: groups kept per token.
    routed_scaling_factor: multiplies the renormalised weights.
    renormalize: divide the selected scores by their sum (False: the raw
      sigmoid scores, `norm_topk_prob=False` in Hugging Face configs).

  Returns:
    (idx [...,A] int32 expert ids, weights [...,A] float32 from the raw
    scores).
  """
  E = scores.shape[-1]
  sel = scores + jax.lax.stop_gradient(bias).astype(scores.dtype)
  sel = jax.lax.stop_gradient(sel)
  if n_group > 1:
    grouped = sel.reshape(*sel.shape[:-1], n_group, E // n_group)
    top2 = jax.lax.top_k(grouped, min(2, E // n_group))[0].sum(-1)  # [...,G]
    _, keep = jax.lax.top_k(top2, topk_group)
    group_mask = jax.nn.one_hot(keep, n_group, dtype=jnp.int32).sum(-2) > 0
    expert_mask = jnp.repeat(group_mask, E // n_group, axis=-1)
    sel = jnp.where(expert_mask, sel, -jnp.inf)
  _, idx = jax.lax.top_k(sel, top_k)
  w = jnp.take_along_axis(scores, idx, axis=-1)
  if renormalize:
    w = w / (w.sum(-1, keepdims=True) + 1e-20)
  w = w * routed_scaling_factor
  return idx.astype(jnp.int32), w


def expert_load(idx: jax.Array, num_experts: int,
                valid: Optional[jax.Array] = None) -> jax.Array:
  """Tokens routed to each expert: [E] float32 (padding tokens excluded).

  Args:
    idx: [...,A] expert ids.
    num_experts: E.
    valid: optional bool mask like `idx[..., 0]`.
  """
  onehot = jax.nn.one_hot(idx, num_experts, dtype=jnp.float32)  # [...,A,E]
  if valid is not None:
    onehot = onehot * valid.astype(jnp.float32)[..., None, None]
  return onehot.sum(tuple(range(onehot.ndim - 1)))


def update_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
  """`bias + rate * sign(mean(load) - load)` (DeepSeek-V3's update)."""
  load = load.astype(jnp.float32)
  return (bias.astype(jnp.float32)
          + rate * jnp.sign(load.mean(-1, keepdims=True) - load)
          ).astype(bias.dtype)


class BiasSlot(NamedTuple):
  """One MoE module's selection bias and its rows of the expert load.

  Attributes:
    module: the module path, e.g. "layer_1/moe".
    rows: its rows of `aux["expert_load"]` [MoE layers, E].
    stacked: the bias is [len(rows), E] (a scanned layer group), else [E].
  """
  module: str
  rows: tuple[int, ...]
  stacked: bool


def update_selection_biases(params: hk.Params, old_params: hk.Params,
                            expert_load: jax.Array, slots: list[BiasSlot],
                            rate: float) -> hk.Params:
  """The training step's selection-bias update, after the optimizer's.

  The optimizer never moves a selection bias (no gradient reaches it): each
  one is set from its value before the step, `old_params`, moved by
  `update_bias` from the step's own load.

  Args:
    params: the parameters after the optimizer update (not modified).
    old_params: the parameters before it.
    expert_load: [MoE layers, E] tokens per expert (`aux["expert_load"]`).
    slots: where the biases live (`kda_lm.model.router_bias_slots`).
    rate: `config.model.router_bias_update_rate`.

  Returns:
    `params` with every `<module>/e_score_correction_bias` replaced.
  """
  new = dict(params)
  for slot in slots:
    load = (expert_load[np.asarray(slot.rows)] if slot.stacked
            else expert_load[slot.rows[0]])
    entry = dict(new[slot.module])
    entry[BIAS_NAME] = update_bias(old_params[slot.module][BIAS_NAME], load,
                                   rate)
    new[slot.module] = entry
  return type(params)(new) if isinstance(params, dict) else new


def load_metrics(expert_load: jax.Array) -> dict[str, jax.Array]:
  """Load balance of `aux["expert_load"]` [layers, E].

  Returns:
    `moe_load_max` / `moe_load_min`: the largest / smallest fraction of a
    layer's routed tokens that one expert received, over all MoE layers
    (uniform = 1/E), and `moe_load_imbalance`: the worst layer's max / mean
    (E times `moe_load_max`).
  """
  frac = expert_load / jnp.maximum(expert_load.sum(-1, keepdims=True), 1.0)
  return {"moe_load_max": frac.max(), "moe_load_min": frac.min(),
          "moe_load_imbalance": frac.max() * frac.shape[-1]}


def dispatch_swiglu(x_MD: jax.Array, idx: jax.Array, w: jax.Array,
                    w_gate_EDF: jax.Array, w_up_EDF: jax.Array,
                    w_down_EFD: jax.Array, *, impl: str = "auto",
                    limit: float = 0.0) -> jax.Array:
  """`sum_j w[n,j] SwiGLU_{idx[n,j]}(x[n])` by sort + grouped matmul.

  Args:
    x_MD: [M,D] tokens.
    idx: [M,A] expert ids.
    w: [M,A] combine weights.
    w_gate_EDF, w_up_EDF: [E,D,F] expert input weights.
    w_down_EFD: [E,F,D] expert output weights.
    impl: the grouped matmul's implementation (`kda_lm.ops.gmm`).
    limit: the experts' SwiGLU clamp (`mlp.swiglu`; 0 = none).

  Returns:
    [M,D] in `x_MD`'s dtype.
  """
  M, A = idx.shape
  E = w_gate_EDF.shape[0]
  flat = idx.reshape(-1)                                     # [M*A]
  order = jnp.argsort(flat, stable=True)
  inverse = _inverse(order)
  sizes = jnp.bincount(flat, length=E).astype(jnp.int32)    # [E]
  out = _grouped_swiglu(_sorted_copies(x_MD, order, inverse, A), sizes,
                        w_gate_EDF, w_up_EDF, w_down_EFD, impl,
                        limit)                               # [M*A,D]
  out = _permute(out, inverse, order).reshape(M, A, -1)
  return _combine(out, w, x_MD.dtype)


def _inverse(order):
  """The inverse of a permutation."""
  return jnp.zeros_like(order).at[order].set(
      jnp.arange(order.shape[0], dtype=order.dtype))


# The two row gathers of `dispatch_swiglu` with gradients that gather too:
# autodiff would scatter-add the cotangent rows, which is slow on TPUs,
# although each gather reads every row a known number of times.


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _sorted_copies(x_MD, order, inverse, A):
  """[M*A,D]: row i is `x[order[i] // A]` (each token once per pair)."""
  return x_MD[order // A]


def _sorted_copies_fwd(x_MD, order, inverse, A):
  return _sorted_copies(x_MD, order, inverse, A), inverse


def _sorted_copies_bwd(A, inverse, g):
  per_pair = g[inverse].reshape(-1, A, g.shape[-1])
  return per_pair.astype(jnp.float32).sum(1).astype(g.dtype), None, None


_sorted_copies.defvjp(_sorted_copies_fwd, _sorted_copies_bwd)


@jax.custom_vjp
def _permute(x, perm, inverse):
  """`x[perm]` for a permutation `perm` whose inverse is `inverse`."""
  return x[perm]


def _permute_fwd(x, perm, inverse):
  return x[perm], inverse


def _permute_bwd(inverse, g):
  return g[inverse], None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def _combine(out_MAD, w, dt):
  """`sum_j w[n,j] out[n,j]` in float32, cast to `dt`."""
  return jnp.einsum("nkd,nk->nd", out_MAD.astype(jnp.float32),
                    w.astype(jnp.float32)).astype(dt)


def _grouped_swiglu(rows, sizes, w_gate_EDF, w_up_EDF, w_down_EFD, impl,
                    limit, real_rows=None):
  """Rows sorted by expert (`sizes` per expert) through their SwiGLUs; the
  gate and up projections as one grouped matmul of twice the width.
  `real_rows`: the rows `sizes` cover on average (`gmm.gmm`'s `rows`)."""
  dt, F = rows.dtype, w_gate_EDF.shape[-1]
  mm = functools.partial(gmm.gmm, group_sizes=sizes, impl=impl,
                         rows=real_rows)
  w_in = jnp.concatenate([w_gate_EDF.astype(dt), w_up_EDF.astype(dt)], -1)
  gate_up = mm(rows, w_in)
  h = mlp.swiglu(gate_up[:, :F], gate_up[:, F:], limit)
  return mm(h, w_down_EFD.astype(dt))


def exchange_capacity(M: int, A: int, E: int, shards: int,
                      capacity_factor: Optional[float] = None) -> int:
  """Pairs one device takes from each device (`expert_parallel_swiglu`):
  the no-drop bound `M * min(A, E)` (E local experts), or less with a
  capacity factor."""
  bound = M * min(A, E)
  if capacity_factor is None:
    return bound
  return max(1, min(bound, math.ceil(capacity_factor * M * A / shards)))


def expert_parallel_swiglu(x_MD: jax.Array, idx: jax.Array, w: jax.Array,
                           w_gate_EDF: jax.Array, w_up_EDF: jax.Array,
                           w_down_EFD: jax.Array, *, shards: int,
                           impl: str = "auto",
                           capacity_factor: Optional[float] = None,
                           limit: float = 0.0,
                           ragged: Optional[bool] = None) -> jax.Array:
  """`dispatch_swiglu` with the experts split over `shards` devices.

  Runs inside `parallel_maps.expert_map`: this device's tokens, its
  E/n experts (here `E` is that local count); expert ids are global.

  Args:
    x_MD: [M,D] this device's tokens.
    idx: [M,A] global expert ids in [0, shards * E).
    w: [M,A] combine weights.
    w_gate_EDF, w_up_EDF: [E,D,F] this device's experts' input weights.
    w_down_EFD: [E,F,D] their output weights.
    shards: n, the `expert` axis size.
    impl: the grouped matmul's implementation.
    capacity_factor: None (no pair dropped) or c (`exchange_capacity`).
    limit: the experts' SwiGLU clamp (`mlp.swiglu`; 0 = none).
    ragged: exchange only the real rows (`ragged_all_to_all`) or a padded
      [n, cap, D] buffer (`all_to_all`); None: ragged where the backend
      runs it (`parallel_maps.ragged_exchange_supported`).

  Returns:
    [M,D] in `x_MD`'s dtype.
  """
  M, A = idx.shape
  E = w_gate_EDF.shape[0]
  cap = exchange_capacity(M, A, E, shards, capacity_factor)
  flat = idx.reshape(-1)                                     # [M*A]
  order = jnp.argsort(flat, stable=True)
  counts = jnp.bincount(flat, length=shards * E).astype(jnp.int32).reshape(
      shards, E)                                             # per target
  send = counts.sum(1)
  start = jnp.cumsum(send) - send
  # Pairs kept per target expert: the first `cap` to each device.
  before = jnp.cumsum(counts, axis=1) - counts
  counts = jnp.clip(cap - before, 0, counts)
  got_counts = parallel_maps.expert_exchange(counts)         # [n,E] by src
  # Over the `expert` group every device receives M*A rows on average.
  experts = functools.partial(_local_experts, weights=(
      w_gate_EDF, w_up_EDF, w_down_EFD), impl=impl, limit=limit,
      real_rows=min(M * A, shards * cap))
  if ragged is None:
    ragged = parallel_maps.ragged_exchange_supported()
  exchange = _ragged_exchange if ragged else _padded_exchange
  out = exchange(x_MD, flat, order, start, counts, got_counts, cap, experts)
  return _combine(out.reshape(M, A, -1), w, x_MD.dtype)


def _local_experts(rows_RD, local_R, got_counts, weights, impl, limit,
                   real_rows):
  """The received rows through this device's experts, in their order.

  Args:
    rows_RD: [R,D] received rows.
    local_R: [R] each row's local expert (E for an empty slot).
    got_counts: [n,E] rows received per source and local expert.
    weights: the local experts' (gate, up, down) weights.
    impl, limit: as `expert_parallel_swiglu`.
    real_rows: the rows received on average (`gmm.gmm`'s `rows`).
  """
  perm = jnp.argsort(local_R, stable=True)
  out = _grouped_swiglu(rows_RD[perm], got_counts.sum(0), *weights, impl,
                        limit, real_rows)
  return out[_inverse(perm)]


def _padded_exchange(x_MD, flat, order, start, counts, got_counts, cap,
                     experts):
  """The pairs' rows out and back in `[n, cap, D]` buffers (`all_to_all`):
  slot j holds the rows for device j. Returns [M*A,D] per pair (zero for
  the pairs past capacity)."""
  MA, D = order.shape[0], x_MD.shape[-1]
  A = MA // x_MD.shape[0]
  slot = jnp.arange(cap, dtype=jnp.int32)
  pair = order[jnp.minimum(start[:, None] + slot, MA - 1)]   # [n,cap]
  used = (slot < counts.sum(1)[:, None])[..., None]
  buf = jnp.where(used, x_MD[pair // A], jnp.zeros((), x_MD.dtype))
  got = parallel_maps.expert_exchange(buf)                   # [n,cap,D]
  # Each source's rows come sorted by local expert; `E` marks empty slots.
  ends = jnp.cumsum(got_counts, axis=1)
  local = (slot[None, :, None] >= ends[:, None, :]).sum(-1).reshape(-1)
  out = experts(got.reshape(-1, D), local, got_counts)
  back = parallel_maps.expert_exchange(out.reshape(got.shape))
  target = flat // got_counts.shape[1]
  at = _inverse(order) - start[target]
  return jnp.where((at < cap)[:, None],
                   back[target, jnp.minimum(at, cap - 1)],
                   jnp.zeros((), back.dtype))


def _ragged_exchange(x_MD, flat, order, start, counts, got_counts, cap,
                     experts):
  """The pairs' rows out and back with `ragged_all_to_all`: only the real
  rows move. Sent: the run of expert-sorted pairs for each device (its
  first `cap`); received: packed by source into an [n*cap, D] buffer.
  Returns [M*A,D] per pair (zero for the pairs past capacity)."""
  del flat
  MA, D = order.shape[0], x_MD.shape[-1]
  n, E = got_counts.shape
  A = MA // x_MD.shape[0]
  sent = counts.sum(1)                                       # [n] to each
  got = got_counts.sum(1)                                    # [n] from each
  got_at = jnp.cumsum(got) - got
  inverse = _inverse(order)
  # The receiving buffer is sized for the worst case; on average M*A of
  # its rows arrive (stated for readers of the compiled program's bytes).
  scope = gmm.ROWS_SCOPE.format(min(MA, n * cap), n * cap)
  with jax.named_scope(scope):
    rows = parallel_maps.expert_ragged_exchange(
        _sorted_copies(x_MD, order, inverse, A),
        jnp.zeros((n * cap, D), x_MD.dtype), start, sent,
        parallel_maps.expert_exchange(got_at), got)
  ends = jnp.cumsum(got_counts.reshape(-1))                  # by (src, e)
  seg = jnp.searchsorted(ends, jnp.arange(n * cap), "right")
  out = experts(rows, jnp.where(seg < n * E, seg % E, E), got_counts)
  with jax.named_scope(scope):
    back = parallel_maps.expert_ragged_exchange(
        out, jnp.zeros((MA, D), out.dtype), got_at, got,
        parallel_maps.expert_exchange(start), sent)          # sorted pairs
  return _permute(back, inverse, order)


def _dispatch(x, idx, w, weights, impl, capacity_factor, limit):
  """`dispatch_swiglu` of `x` ([B,T,D] or [M,D]; `idx`, `w` [...,A]), like
  `x`. Under a device mesh each device sorts and runs only its own tokens;
  with an `expert` axis, through the experts of every device on that
  axis."""
  D, A = x.shape[-1], idx.shape[-1]
  if x.ndim != 3 or not parallel_maps.under_mesh():
    return dispatch_swiglu(x.reshape(-1, D), idx.reshape(-1, A),
                           w.reshape(-1, A), *weights, impl=impl,
                           limit=limit).reshape(x.shape)

  shards = parallel_maps.expert_size()
  # Chosen for the layer's experts, not each device's share of them.
  impl = gmm.resolve_impl(impl, weights[0].shape[0])

  def local(x_BTD, idx_BTA, w_BTA, *weights):
    b, t = x_BTD.shape[:2]
    args = (x_BTD.reshape(-1, D), idx_BTA.reshape(-1, A),
            w_BTA.reshape(-1, A), *weights)
    if shards > 1:
      cap = exchange_capacity(b * t, A, weights[0].shape[0], shards,
                              capacity_factor)
      logging.info("Expert-parallel MoE: %d experts per device of %d, %d "
                   "tokens per device, capacity factor %s: %d pairs from "
                   "each device.", weights[0].shape[0],
                   weights[0].shape[0] * shards, b * t, capacity_factor, cap)
      y = expert_parallel_swiglu(*args, shards=shards, impl=impl,
                                 capacity_factor=capacity_factor, limit=limit)
    else:
      y = dispatch_swiglu(*args, impl=impl, limit=limit)
    return y.reshape(b, t, D)

  tokens = [x, idx, w]
  check_vma = impl != "megablox"
  if shards > 1:
    return parallel_maps.expert_map(local, tokens, list(weights),
                                       check_vma)
  return parallel_maps.token_map(local, tokens, list(weights), check_vma)


class MoE(hk.Module):
  """Routed SwiGLU experts (sigmoid router, top-k) plus shared experts."""

  def __init__(self, num_experts: int, num_experts_per_tok: int,
               intermediate_size: int, *, num_shared_experts: int = 1,
               routed_scaling_factor: float = 1.0, n_group: int = 1,
               topk_group: int = 1, renormalize: bool = True,
               param_dtype=jnp.float32, impl: str = "auto",
               capacity_factor: Optional[float] = None,
               swiglu_limit: float = 0.0, shared_swiglu_limit: float = 0.0,
               name: Optional[str] = None):
    """Initialises the module.

    Args:
      num_experts: E routed experts.
      num_experts_per_tok: A.
      intermediate_size: F, each expert's hidden width.
      num_shared_experts: shared experts, fused into one SwiGLU of width
        `num_shared_experts * F` (0 = none).
      routed_scaling_factor: multiplies the renormalised top-k weights.
      n_group: expert groups (1 = plain top-k).
      topk_group: groups each token may pick experts from.
      renormalize: renormalise the top-k weights (see `route`).
      param_dtype: dtype of the expert weights (router weight and bias are
        float32).
      impl: the routed experts' grouped matmul (`kda_lm.ops.gmm`).
      capacity_factor: under expert parallelism, None (no pair dropped)
        or the exchange's capacity factor (`exchange_capacity`).
      swiglu_limit: the routed experts' SwiGLU clamp (`mlp.swiglu`; 0 =
        none).
      shared_swiglu_limit: the shared experts' clamp.
      name: module name.

    Raises:
      ValueError: inconsistent router sizes.
    """
    super().__init__(name=name)
    check_dims(num_experts=num_experts,
               num_experts_per_tok=num_experts_per_tok, n_group=n_group,
               topk_group=topk_group)
    self.num_experts, self.top_k = num_experts, num_experts_per_tok
    self.hidden = intermediate_size
    self.num_shared = num_shared_experts
    # `route`'s selection settings.
    self.routing = dict(n_group=n_group, topk_group=topk_group,
                        routed_scaling_factor=routed_scaling_factor,
                        renormalize=renormalize)
    self.param_dtype = param_dtype
    self.impl = impl
    self.capacity_factor = capacity_factor
    self.limits = (float(swiglu_limit), float(shared_swiglu_limit))

  def __call__(self, x: jax.Array, valid: Optional[jax.Array] = None
               ) -> tuple[jax.Array, jax.Array]:
    """Applies the MoE.

    Args:
      x: [B,T,D] (or [M,D]).
      valid: optional bool mask like `x[..., 0]` of the tokens that count
        toward the load (False on padding).

    Returns:
      (y like x, load [E] float32 token counts per expert).
    """
    # Tokens keep their leading dims throughout: flattening [B,T] to [M]
    # outside `shard_map` merges a batch-sharded and a context-sharded dim,
    # which GSPMD cannot tile once a device holds two or more rows, so it
    # would replicate the router and shared experts over `context`.
    D, E, F = x.shape[-1], self.num_experts, self.hidden
    w_router = hk.get_parameter(
        "router", [D, E], jnp.float32,
        init=hk.initializers.TruncatedNormal(D ** -0.5))
    bias = hk.get_parameter(BIAS_NAME, [E], jnp.float32, init=jnp.zeros)
    with jax.named_scope("router"):    # Names the ops in profiles.
      scores = jax.nn.sigmoid(jnp.dot(x.astype(jnp.float32), w_router))
      idx, w = route(scores, bias, self.top_k, **self.routing)
    init_in = hk.initializers.TruncatedNormal(D ** -0.5)
    init_out = hk.initializers.TruncatedNormal(F ** -0.5)
    pdt = self.param_dtype
    w_gate = hk.get_parameter("gate_proj", [E, D, F], pdt, init=init_in)
    w_up = hk.get_parameter("up_proj", [E, D, F], pdt, init=init_in)
    w_down = hk.get_parameter("down_proj", [E, F, D], pdt, init=init_out)
    with jax.named_scope("routed"):
      y = _dispatch(x, idx, w, (w_gate, w_up, w_down), self.impl,
                    self.capacity_factor, self.limits[0])
    if self.num_shared:
      y = y + mlp.SwiGLU(self.num_shared * F, limit=self.limits[1],
                         param_dtype=pdt, name="shared_experts")(x)
    return y, expert_load(idx, E, valid)


def param_count(d_model: int, num_experts: int, intermediate_size: int,
                num_shared_experts: int) -> int:
  """Parameters of one MoE layer (router, bias, experts, shared experts)."""
  D, E, F = d_model, num_experts, intermediate_size
  return D * E + E + 3 * E * D * F + 3 * D * F * num_shared_experts
