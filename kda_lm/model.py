r"""The hybrid Ling 3.0 / Kimi Linear style decoder (KDA + MLA), in Haiku.

Shapes: `docs/glossary.md` is the project's one shape glossary (B rows,
T tokens, D width, W vocabulary, ...); every module names arrays by it.

  x = embed(tokens)                                       [B,T,D]
  for each character c of `attention_pattern` (K = KDA, M = MLA):
    x = x + mixer_c(RMSNorm(x), segment_ids, positions)
    x = x + SwiGLU(RMSNorm(x))
  logits = LM head(RMSNorm(x))                            [B,T,W] float32

`segment_ids [B,T]` (1-based documents, 0 = padding; `kda_lm/segments.py`)
reach every KDA layer (state and short-conv resets), every MLA layer (mask)
and the MTP targets; positions restart
at 0 per document. A packed row gives each document the logits it would
have alone.

Usage:

  run = kda_lm.config.check_config(config)   # config.model read, typed
  model = kda_lm.model.build(run.model)
  params = model.init(rng, tokens, segment_ids)
  logits = model.apply(params, tokens, segment_ids)

  python -m kda_lm.model --config=configs/ling3_tiny.py   # parameter table
"""

import dataclasses
from typing import Any, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from kda_lm import config as config_lib
from kda_lm import segments, stack
from kda_lm.layers import block, kda, linear, mla, moe, mtp, norm

# A decode cache: one `kda.KDACache` or `mla.MLACache` per unrolled layer
# and per slot of a scanned group (stacked over its repeats; `decoder_stack`).
Cache = tuple


def ling_pattern(num_layers: int, layer_group_size: int) -> str:
  """Ling 3.0's layout rule as an `attention_pattern` string.

  Layer i (0-based) is MLA iff `(i + 1) % layer_group_size == 0`, and a
  trailing partial group ends in MLA.

  Args:
    num_layers: number of decoder layers, >= 1.
    layer_group_size: G, >= 1 (1 = all MLA).

  Returns:
    A string of `K` and `M`, e.g. "KKKM" for (4, 4), "KKKMKM" for (6, 4).

  Raises:
    ValueError: a non-positive argument.
  """
  if num_layers < 1 or layer_group_size < 1:
    raise ValueError(f"num_layers and layer_group_size must be >= 1, got "
                     f"{num_layers}, {layer_group_size}.")
  kinds = ["M" if (i + 1) % layer_group_size == 0 else "K"
           for i in range(num_layers)]
  kinds[-1] = "M"
  return "".join(kinds)


def _check_int_array(name: str, x: Any, shape: Optional[tuple[int, ...]]):
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise ValueError(f"{name} must be an array, got {type(x).__name__}.")
  if shape is None and x.ndim != 2:
    raise ValueError(f"{name} must be [B,T], got shape {x.shape}.")
  if shape is not None and tuple(x.shape) != shape:
    raise ValueError(f"{name} must have the shape of tokens [B,T] = {shape}, "
                     f"got {tuple(x.shape)}.")
  if not jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
    raise ValueError(f"{name} must be an integer array, got {x.dtype}.")


def check_tokens(tokens: Any, vocab_size: int, what: str = "tokens") -> None:
  """Raises if concrete `tokens` hold ids outside `[0, vocab_size)`.

  The one token-id check: the model's entry calls it, and the training loop
  on every host batch. The embedding lookup cannot raise under `jit`, so
  tracers are skipped (they read NaN rows, see `forward`).

  Args:
    tokens: int token ids (an array or a tracer).
    vocab_size: W, `config.model.vocab_size`.
    what: names the ids in the message, e.g. "The batch of step 3: inputs".

  Raises:
    ValueError: an id out of range (the message names it and `what`).
  """
  try:
    ids = np.asarray(tokens)
  except (jax.errors.TracerArrayConversionError,
          jax.errors.ConcretizationTypeError):
    return
  if not ids.size:
    return
  lo, hi = int(ids.min()), int(ids.max())
  if lo < 0 or hi >= vocab_size:
    bad = lo if lo < 0 else hi
    raise ValueError(
        f"{what} has token id {bad} outside the model vocabulary "
        f"[0, {vocab_size}) (config.model.vocab_size); found ids in "
        f"[{lo}, {hi}].")


def _check_inputs(cfg, tokens, segment_ids, positions, decoding):
  """Validates the inputs once, at the model's entry.

  Returns:
    int32 (segment_ids or None, positions or None): positions are derived
    from `segment_ids` when not given, except in a decode step, where the
    MLA cache knows each row's position.
  """
  _check_int_array("tokens", tokens, None)
  shape = tuple(tokens.shape)
  check_tokens(tokens, cfg.vocab_size)
  if decoding:
    if segment_ids is not None or positions is not None:
      raise ValueError("A decode step (with `cache`) takes neither "
                       "segment_ids nor positions: the cache holds them.")
    return None, None
  segment_ids = segments.check(segment_ids, shape)
  if positions is not None:
    _check_int_array("positions", positions, shape)
  B, T = shape
  if positions is None:
    positions = (jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
                 if segment_ids is None else
                 segments.positions_from_segment_ids(segment_ids))
  return segment_ids, positions.astype(jnp.int32)


def embed(cfg: config_lib.ModelConfig, emb_WD: jax.Array,
          tokens: jax.Array) -> jax.Array:
  """`[B,T]` token ids to `[B,T,D]` embeddings in the compute dtype.

  Under jit an out-of-range id (negative ones included, which `take` would
  wrap) reads NaN instead of being clipped to a valid row.
  """
  ids_BT = jnp.where(tokens < 0, cfg.vocab_size, tokens)
  return jnp.take(emb_WD, ids_BT, axis=0, mode="fill").astype(
      jnp.dtype(cfg.compute_dtype))


def embedding_and_head(cfg: config_lib.ModelConfig):
  """The embedding table [W,D] and the LM head `[B,T,D] -> [B,T,W]`."""
  pdt = jnp.dtype(cfg.param_dtype)
  with hk.name_scope("embed"):
    emb_WD = hk.get_parameter(
        "embeddings", [cfg.vocab_size, cfg.d_model], pdt,
        init=hk.initializers.TruncatedNormal(cfg.embed_init_std))
  if cfg.tie_embeddings:
    cdt = jnp.dtype(cfg.compute_dtype)
    head = lambda y: jnp.einsum("btd,wd->btw", y, emb_WD.astype(cdt),
                                preferred_element_type=jnp.float32)
  else:
    head = linear.Dense(cfg.vocab_size, param_dtype=pdt,
                        out_dtype=jnp.float32, name="lm_head")
  return emb_WD, head


def head_weight(cfg: config_lib.ModelConfig, params: hk.Params
                ) -> jax.Array:
  """The LM head's [D,W] weight in `params` (the embedding table's
  transpose when tied): what `embedding_and_head`'s head multiplies by."""
  if cfg.tie_embeddings:
    return params["embed"]["embeddings"].T
  return params["lm_head"]["w"]


def _mtp_layers(cfg, emb_BTD, h_BTD, head, segment_ids, positions):
  """The MTP blocks: ([num_mtp_layers, B,T,W] logits (or, with `head` the
  identity, final hidden states [.., B,T,D]), their MoE loads)."""
  pdt = jnp.dtype(cfg.param_dtype)
  logits, loads = [], []
  for k in range(1, cfg.num_mtp_layers + 1):
    # Layer k reads t_{i+k}; zeroed outside position i's segment.
    same_BT = segments.same_segment_ahead(segment_ids, k,
                                          tuple(emb_BTD.shape[:2]))
    e_BTD = jnp.where(same_BT[..., None], mtp.shift_left(emb_BTD, k),
                      0).astype(emb_BTD.dtype)
    with hk.name_scope(f"mtp_{k - 1}"):
      h_BTD = mtp.MTPInput(cfg.norm_eps, pdt, name="input")(e_BTD, h_BTD)
      h_BTD, load = block.DecoderBlock(cfg.mtp_layer_kind, cfg,
                                 bool(cfg.num_experts), name="block")(
                                     h_BTD, segment_ids, positions)
      if load is not None:
        loads.append(load[None])
      logits.append(head(norm.RMSNorm(cfg.norm_eps, pdt,
                                      name="final_norm")(h_BTD)))
  return logits, loads


def _run_block(cfg: config_lib.ModelConfig, layer: int, name: str,
               x_BTD: jax.Array, segment_ids, positions, *, with_cache: bool,
               cache: Any, max_len: Optional[int], remat: str,
               in_scan: bool) -> tuple[jax.Array, Any, Any]:
  """One decoder layer (layer index `layer`'s kinds, module `name`).

  Returns:
    (x [B,T,D], MoE load [1,E] or None, the layer's cache or None).
  """
  layer_fn = block.DecoderBlock(cfg.attention_pattern[layer], cfg,
                                cfg.is_moe_layer(layer), name=name,
                                limits=cfg.swiglu_limits(layer))
  if with_cache:
    x_BTD, load, cache = layer_fn(x_BTD, segment_ids, positions, cache=cache,
                               max_len=max_len if cache is None else None)
  else:
    fn = stack.rematted(lambda x, s, p: layer_fn(x, s, p), remat,
                        in_scan=in_scan)
    x_BTD, load = fn(x_BTD, segment_ids, positions)
  return x_BTD, None if load is None else load[None], cache


def _scanned_group(cfg, plan: stack.LayerPlan, x_BTD, segment_ids,
                   positions, *, with_cache: bool, cache: Optional[tuple],
                   max_len: Optional[int], remat: str):
  """The group's N repeats under one `hk.layer_stack`.

  Returns:
    (x, MoE loads [N * MoE slots, E] in layer order or None, the slots'
    caches stacked over N or None).
  """
  def body(x_BTD, _, slot_caches):
    loads, caches = [], []
    for j in range(plan.period):
      x_BTD, load, layer_cache = _run_block(
          cfg, plan.layer(0, j), stack.slot_name(j), x_BTD, segment_ids,
          positions, with_cache=with_cache,
          cache=None if slot_caches is None else slot_caches[j],
          max_len=max_len, remat=remat, in_scan=True)
      if load is not None:
        loads.append(load[0])
      caches.append(layer_cache)
    return x_BTD, (tuple(loads), tuple(caches) if with_cache else None)

  scan = hk.layer_stack(plan.repeats, with_per_layer_inputs=True,
                        name=stack.SCAN_NAME)
  x_BTD, (loads, caches) = scan(body)(
      x_BTD, jnp.arange(plan.repeats), cache)
  if not loads:
    return x_BTD, None, caches
  # [N, slots, E] -> rows r-major, slot-minor: the layer order.
  return (x_BTD, jnp.stack(loads, axis=1).reshape(-1, loads[0].shape[-1]),
          caches)


def decoder_stack(cfg: config_lib.ModelConfig, x_BTD: jax.Array,
                  segment_ids: Optional[jax.Array],
                  positions: Optional[jax.Array], *,
                  cache: Optional[Cache] = None,
                  max_len: Optional[int] = None, remat: str = "none"
                  ) -> tuple[jax.Array, list[jax.Array], Optional[Cache]]:
  """The layers of `attention_pattern`, in one of three modes.

  * training: `cache` and `max_len` None; returns no cache; each layer
    under the `remat` policy (`kda_lm.stack`);
  * prefill: `max_len` (cache slots per row) given; returns each layer's
    cache after the prompt;
  * decode: `cache` given (one token per row); returns the updated cache.

  With `scan_layers`, the group of `stack.layer_plan` runs as one scan.
  The cache holds one entry per unrolled layer and one per group slot
  (stacked over the repeats), in layer order.

  Returns:
    (x [B,T,D], MoE loads as [k,E] blocks in layer order, the cache or
    None).
  """
  plan = stack.layer_plan(cfg)
  with_cache = cache is not None or max_len is not None
  entries = iter(cache if cache is not None else ())
  loads, new_cache = [], []

  def unrolled(layers, x_BTD):
    for i in layers:
      x_BTD, load, layer_cache = _run_block(
          cfg, i, stack.layer_name(i), x_BTD, segment_ids, positions,
          with_cache=with_cache, cache=next(entries, None),
          max_len=max_len, remat=remat, in_scan=False)
      loads.extend([] if load is None else [load])
      new_cache.append(layer_cache)
    return x_BTD

  x_BTD = unrolled(plan.head, x_BTD)
  if plan.period:
    slots = None if cache is None else tuple(
        next(entries) for _ in range(plan.period))
    x_BTD, group_loads, slot_caches = _scanned_group(
        cfg, plan, x_BTD, segment_ids, positions, with_cache=with_cache,
        cache=slots, max_len=max_len, remat=remat)
    loads.extend([] if group_loads is None else [group_loads])
    new_cache.extend(slot_caches or ())
  x_BTD = unrolled(plan.tail, x_BTD)
  return x_BTD, loads, tuple(new_cache) if with_cache else None


def forward(cfg: config_lib.ModelConfig, tokens: jax.Array,
            segment_ids: Optional[jax.Array] = None,
            positions: Optional[jax.Array] = None, *,
            return_aux: bool = False, cache: Optional[Cache] = None,
            max_len: Optional[int] = None, remat: str = "none",
            logits: bool = True) -> Any:
  """The decoder; call inside `hk.transform` (see `build`).

  Training, prefill and decode are three modes of this one function (see
  `decoder_stack`); `kda_lm.infer.decoding` drives the last two.

  Args:
    cfg: the model config.
    tokens: [B,T] int token ids in `[0, vocab_size)`.
    segment_ids: optional [B,T] int, 1-based document ids, 0 = padding.
      None = one document per row.
    positions: optional [B,T] int RoPE positions. None = derived from
      `segment_ids` (0 at each document start, 0 on padding), or 0..T-1.
    return_aux: also return a dict of auxiliary outputs (training mode).
    cache: decode mode: the cache of the previous prefill or step (one
      `KDACache` or `MLACache` per layer); `tokens` is [B,1].
    max_len: prefill mode: S, the cache slots per row.
    remat: training mode: what each layer keeps for the backward pass
      (`kda_lm.stack.REMAT_POLICIES`).
    logits: training mode: False returns the final hidden states [B,T,D]
      (after the final norm, in the compute dtype) in place of the logits,
      and `mtp_hidden` in place of `mtp_logits`, for a loss that applies
      the head itself (`kda_lm.losses`, `head_weight`).

  Returns:
    [B,T,W] float32 logits (padding rows hold finite garbage); with
    `return_aux`, `(logits, aux)` where `aux` may hold `expert_load`
    [MoE layers, E] float32 (tokens routed to each expert, padding not
    counted; MTP blocks' MoE layers last) and `mtp_logits`
    [num_mtp_layers, B,T,W] float32 (layer k-1 predicts t_{i+k+1}).
    In prefill and decode mode, `(logits, cache)`; MTP layers are not run.

  Raises:
    ValueError: a malformed `tokens`, or `segment_ids`/`positions` whose
      shape differs from `tokens`; concrete token ids out of range.
  """
  with_cache = cache is not None or max_len is not None
  if with_cache and (return_aux or not logits):
    raise ValueError("return_aux and logits=False are for training mode "
                     "(no cache).")
  segment_ids, positions = _check_inputs(cfg, tokens, segment_ids,
                                         positions, cache is not None)
  pdt = jnp.dtype(cfg.param_dtype)
  emb_WD, head = embedding_and_head(cfg)
  emb_BTD = embed(cfg, emb_WD, tokens)
  x_BTD, loads, cache = decoder_stack(cfg, emb_BTD, segment_ids, positions,
                                      cache=cache, max_len=max_len,
                                      remat=remat)
  if not logits and not hk.running_init():
    # The loss applies the head: "logits" below are the hidden states.
    head = lambda y_BTD: y_BTD  # noqa: E731
  logits_BTW = head(norm.RMSNorm(cfg.norm_eps, pdt, name="final_norm")(
      x_BTD))
  if with_cache:
    return logits_BTW, cache
  if not return_aux and not (cfg.num_mtp_layers and hk.running_init()):
    return logits_BTW
  mtp_logits, mtp_loads = _mtp_layers(cfg, emb_BTD, x_BTD, head,
                                      segment_ids, positions)
  loads += mtp_loads
  aux = {}
  if loads:
    aux["expert_load"] = jnp.concatenate(loads)
  if mtp_logits:
    aux["mtp_logits" if logits else "mtp_hidden"] = jnp.stack(mtp_logits)
  return (logits_BTW, aux) if return_aux else logits_BTW


def build(model_config: config_lib.ModelConfig, *, remat: str = "none"
          ) -> hk.Transformed:
  """Builds the model.

  Args:
    model_config: the model's settings, typed (a run's `RunConfig.model`,
      or `kda_lm.config.ModelConfig.from_config(config.model)`).
    remat: the training step's rematerialisation policy per layer
      (`config.train.remat`, `kda_lm.stack.REMAT_POLICIES`).

  Returns:
    An `hk.Transformed` without apply rng: `init(rng, tokens,
    segment_ids=None, positions=None)` and `apply(params, tokens,
    segment_ids=None, positions=None, return_aux=False, logits=True) ->
    float32 logits [B,T,W]` (or `(logits, aux)`, or hidden states, see
    `forward`). MoE selection biases
    are parameters that gradients never reach (`router_bias_slots` lists
    them; `kda_lm.layers.moe.update_selection_biases` moves them). With
    `scan_layers`, `init` gives the unscanned model's parameters in the
    scanned layout (`kda_lm.stack.to_scanned`).

  Raises:
    TypeError: `model_config` is not a `ModelConfig` (a ConfigDict, say).
    ValueError: an unknown `remat`.
  """
  cfg = config_lib.typed_model(model_config, "kda_lm.model.build")
  stack.check_remat(remat)

  def fn(tokens, segment_ids=None, positions=None, return_aux=False,
         cache=None, max_len=None, logits=True):
    return forward(cfg, tokens, segment_ids, positions,
                   return_aux=return_aux, cache=cache, max_len=max_len,
                   remat=remat, logits=logits)

  transformed = hk.without_apply_rng(hk.transform(fn))
  if not cfg.scan_layers:
    return transformed
  # The same initial parameters as unscanned, stacked: a seed gives one
  # model whatever the layout.
  flat = build(dataclasses.replace(cfg, scan_layers=False), remat=remat)
  return hk.Transformed(
      init=lambda *a, **k: stack.to_scanned(flat.init(*a, **k), cfg),
      apply=transformed.apply)


def _mixer_param_count(cfg: config_lib.ModelConfig, kind: str) -> int:
  D = cfg.d_model
  if kind == "K":
    return kda.param_count(D, cfg.num_heads, cfg.head_dim,
                           head_v_dim=cfg.kda_head_v_dim,
                           gate=cfg.kda_gate, conv_size=cfg.conv_size,
                           conv_bias=cfg.conv_bias)
  return mla.param_count(D, cfg.mla_num_heads,
                         q_lora_rank=cfg.q_lora_rank,
                         kv_lora_rank=cfg.kv_lora_rank,
                         qk_nope_head_dim=cfg.qk_nope_head_dim,
                         qk_rope_head_dim=cfg.qk_rope_head_dim,
                         v_head_dim=cfg.v_head_dim,
                         output_gate=cfg.mla_output_gate,
                         bias=cfg.mla_bias)


def _ffn_param_count(cfg: config_lib.ModelConfig, use_moe: bool) -> int:
  D = cfg.d_model
  if not use_moe:
    return 3 * D * cfg.mlp_hidden_dim
  return moe.param_count(D, cfg.num_experts, cfg.moe_intermediate_size,
                         cfg.num_shared_experts)


def param_count(cfg: config_lib.ModelConfig) -> int:
  """Parameter count by shape arithmetic (checks `init` in tests).

  Args:
    cfg: the model's settings.

  Returns:
    The number of parameters `build(cfg).init` makes.
  """
  D = cfg.d_model
  n = cfg.vocab_size * D + D                      # embedding, final norm
  if not cfg.tie_embeddings:
    n += D * cfg.vocab_size
  for i, kind in enumerate(cfg.attention_pattern):
    n += 2 * D + _mixer_param_count(cfg, kind)       # two norms, mixer
    n += _ffn_param_count(cfg, cfg.is_moe_layer(i))
  kind = cfg.mtp_layer_kind
  n += cfg.num_mtp_layers * (
      2 * D + 2 * D * D                              # enorm, hnorm, eh_proj
      + 2 * D + _mixer_param_count(cfg, kind)
      + _ffn_param_count(cfg, bool(cfg.num_experts))
      + D)                                           # MTP final norm
  return n


def router_bias_modules(cfg: config_lib.ModelConfig) -> list[str]:
  """Module paths of the MoE layers in the unscanned layout, in the order
  of `aux["expert_load"]` (the layer order, MTP blocks last).

  Args:
    cfg: the model's settings.
  """
  paths = [f"{stack.layer_name(i)}/moe" for i in range(cfg.num_layers)
           if cfg.is_moe_layer(i)]
  if cfg.num_experts:
    paths += [f"mtp_{k}/block/moe" for k in range(cfg.num_mtp_layers)]
  return paths


def router_bias_slots(cfg: config_lib.ModelConfig) -> list[moe.BiasSlot]:
  """Where each MoE layer's selection bias lives in the config's layout:
  one `moe.BiasSlot` per MoE module, naming its rows of
  `aux["expert_load"]` (a scanned slot's bias is [N,E], one row a repeat).

  Args:
    cfg: the model's settings (`scan_layers` picks the layout).
  """
  plan = stack.layer_plan(cfg)
  row = {i: n for n, i in enumerate(
      i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))}
  slots = [moe.BiasSlot(f"{stack.layer_name(i)}/moe", (row[i],), False)
           for i in plan.head + plan.tail if i in row]
  for j in range(plan.period):
    if plan.layer(0, j) in row:
      slots.append(moe.BiasSlot(
          f"{stack.SCAN_NAME}/{stack.slot_name(j)}/moe",
          tuple(row[plan.layer(r, j)] for r in range(plan.repeats)), True))
  if cfg.num_experts:
    slots += [moe.BiasSlot(f"mtp_{k}/block/moe", (len(row) + k,), False)
              for k in range(cfg.num_mtp_layers)]
  return slots


def abstract_params(cfg: config_lib.ModelConfig, seq_len: int = 8
                    ) -> hk.Params:
  """Parameter shapes and dtypes (`jax.ShapeDtypeStruct`s), nothing run.

  Args:
    cfg: the model's settings.
    seq_len: tokens of the row `init` is traced on.
  """
  model = build(cfg)
  tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
  return jax.eval_shape(model.init, jax.random.key(0), tokens)


def summary(cfg: config_lib.ModelConfig, *, shapes: bool = True) -> str:
  """A parameter table: one row per top-level layer, then per parameter.

  Args:
    cfg: the model's settings.
    shapes: append a table of every parameter's shape.

  Returns:
    The table as text.
  """
  params = abstract_params(cfg)
  rows = {}
  for module, _, p in hk.data_structures.traverse(params):
    top = module.split("/")[0]
    rows.setdefault(top, 0)
    rows[top] += int(np.prod(p.shape))
  gate = cfg.kda_gate

  def kind(top):
    i = stack.layer_index(top)
    if i is not None:
      c = cfg.attention_pattern[i]
      ffn = "MoE" if cfg.is_moe_layer(i) else "SwiGLU"
      return f"KDA ({gate}) + {ffn}" if c == "K" else f"MLA + {ffn}"
    if top.startswith("mtp_"):
      return "MTP"
    return {"embed": "embedding" + (" (tied head)" if cfg.tie_embeddings
                                    else ""),
            "final_norm": "RMSNorm", "lm_head": "linear"}.get(top, "?")

  order = (["embed"] + [stack.layer_name(i) for i in
                        range(len(cfg.attention_pattern))]
           + ["final_norm", "lm_head"]
           + [f"mtp_{k}" for k in range(cfg.num_mtp_layers)])
  lines = [f"{'layer':<12} {'type':<26} {'parameters':>12}",
           "-" * 52]
  for top in order:
    if top in rows:
      lines.append(f"{top:<12} {kind(top):<26} {rows[top]:>12,}")
  total = sum(rows.values())
  lines += ["-" * 52, f"{'total':<12} {'':<26} {total:>12,}"]
  if shapes:
    lines += ["", f"{'parameter':<44} {'shape':<14} {'count':>9}",
              "-" * 69]
    for module, name, p in hk.data_structures.traverse(params):
      lines.append(f"{module + '/' + name:<44} {str(tuple(p.shape)):<14} "
                   f"{int(np.prod(p.shape)):>9,}")
  return "\n".join(lines)


def _main(argv):
  del argv
  cfg = config_lib.ModelConfig.from_config(_CONFIG.value.model)
  print(summary(cfg, shapes=_SHAPES.value))


if __name__ == "__main__":
  from absl import app, flags
  from ml_collections import config_flags

  _CONFIG = config_flags.DEFINE_config_file(
      "config", None, "Config file with a `model` dict.", lock_config=True)
  _SHAPES = flags.DEFINE_bool("shapes", True,
                              "Also list every parameter's shape.")
  flags.mark_flags_as_required(["config"])
  app.run(_main)
