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

  model = kda_lm.model.build(config.model)
  params = model.init(rng, tokens, segment_ids)
  logits = model.apply(params, tokens, segment_ids)

  python -m kda_lm.model --config=configs/ling3_tiny.py   # parameter table
"""

from typing import Any, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from kda_lm import config as config_lib
from kda_lm import segments
from kda_lm.layers import kda, linear, mla, mlp, moe, mtp, norm

# A decode cache: one `kda.KDACache` or `mla.MLACache` per decoder layer.
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


class DecoderBlock(hk.Module):
  """Pre-norm block: `x + mixer(norm(x))`, then `x + FFN(norm(x))`.

  FFN is a dense SwiGLU, or with `use_moe` the MoE of
  `kda_lm/layers/moe.py`.
  """

  def __init__(self, kind: str, cfg: config_lib.ModelConfig,
               use_moe: bool = False, name: Optional[str] = None):
    """Initialises the module.

    Args:
      kind: "K" (KDA) or "M" (MLA).
      cfg: the model config.
      use_moe: a MoE feed-forward instead of the dense SwiGLU.
      name: module name.
    """
    super().__init__(name=name)
    self.kind = kind
    self.cfg = cfg
    self.use_moe = use_moe

  def __call__(self, x: jax.Array, segment_ids: Optional[jax.Array],
               positions: Optional[jax.Array], *, cache: Any = None,
               max_len: Optional[int] = None) -> tuple[Any, ...]:
    """Maps `x [B,T,D]` to (`[B,T,D]`, expert load [E] or None).

    With a decode `cache` (the mixer's `KDACache` or `MLACache`) or a
    prefill's `max_len` (see `kda_lm.infer.decoding`), returns `(x, load,
    mixer cache)`.
    """
    cfg = self.cfg
    pdt = jnp.dtype(cfg.param_dtype)
    eps = cfg.norm_eps
    with_cache = cache is not None or max_len is not None
    h = norm.RMSNorm(eps, pdt, name="attn_norm")(x)
    if self.kind == "K":
      h = kda.KimiDeltaAttention(
          cfg.num_heads, cfg.head_dim, head_v_dim=cfg.kda_head_v_dim,
          gate=cfg.kda_gate, conv_size=cfg.conv_size,
          conv_bias=cfg.conv_bias, norm_eps=eps, impl=cfg.kda_impl,
          chunk_size=cfg.kda_chunk_size, param_dtype=pdt, name="kda")(
              h, segment_ids, cache=cache, return_cache=with_cache)
    else:
      h = mla.MultiHeadLatentAttention(
          cfg.mla_num_heads, q_lora_rank=cfg.q_lora_rank,
          kv_lora_rank=cfg.kv_lora_rank,
          qk_nope_head_dim=cfg.qk_nope_head_dim,
          qk_rope_head_dim=cfg.qk_rope_head_dim,
          v_head_dim=cfg.v_head_dim, rope_theta=cfg.rope_theta,
          use_nope=cfg.use_nope, output_gate=cfg.mla_output_gate,
          norm_eps=eps, param_dtype=pdt, name="mla")(
              h, segment_ids, positions, cache=cache, max_len=max_len)
    if with_cache:
      h, cache = h
    x = x + h
    h = norm.RMSNorm(eps, pdt, name="mlp_norm")(x)
    if not self.use_moe:
      out = x + mlp.SwiGLU(cfg.mlp_hidden_dim, param_dtype=pdt,
                           name="mlp")(h), None
    else:
      h, load = moe.MoE(
          cfg.num_experts, cfg.num_experts_per_tok,
          cfg.moe_intermediate_size,
          num_shared_experts=cfg.num_shared_experts,
          routed_scaling_factor=cfg.routed_scaling_factor,
          n_group=cfg.n_group, topk_group=cfg.topk_group,
          param_dtype=pdt, impl=cfg.moe_impl,
          capacity_factor=cfg.moe_capacity_factor, name="moe")(
              h, None if segment_ids is None else segment_ids != 0)
      out = x + h, load
    return out + (cache,) if with_cache else out


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


def _mtp_layers(cfg, emb_BTD, h_BTD, head, segment_ids, positions):
  """The MTP blocks: ([num_mtp_layers, B,T,W] logits, their MoE loads)."""
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
      h_BTD, load = DecoderBlock(cfg.mtp_layer_kind, cfg,
                                 bool(cfg.num_experts), name="block")(
                                     h_BTD, segment_ids, positions)
      if load is not None:
        loads.append(load)
      logits.append(head(norm.RMSNorm(cfg.norm_eps, pdt,
                                      name="final_norm")(h_BTD)))
  return logits, loads


def decoder_stack(cfg: config_lib.ModelConfig, x_BTD: jax.Array,
                  segment_ids: Optional[jax.Array],
                  positions: Optional[jax.Array], *,
                  cache: Optional[Cache] = None,
                  max_len: Optional[int] = None
                  ) -> tuple[jax.Array, list[jax.Array], Optional[Cache]]:
  """The layers of `attention_pattern`, in one of three modes.

  * training: `cache` and `max_len` None; returns no cache;
  * prefill: `max_len` (cache slots per row) given; returns each layer's
    cache after the prompt;
  * decode: `cache` given (one token per row); returns the updated cache.

  Returns:
    (x [B,T,D], MoE loads [E] of the MoE layers, the cache or None).
  """
  with_cache = cache is not None or max_len is not None
  loads, new_cache = [], []
  for i, kind in enumerate(cfg.attention_pattern):
    block = DecoderBlock(kind, cfg, cfg.is_moe_layer(i), name=f"layer_{i}")
    if not with_cache:
      x_BTD, load = block(x_BTD, segment_ids, positions)
    else:
      x_BTD, load, layer_cache = block(
          x_BTD, segment_ids, positions,
          cache=None if cache is None else cache[i],
          max_len=max_len if cache is None else None)
      new_cache.append(layer_cache)
    if load is not None:
      loads.append(load)
  return x_BTD, loads, tuple(new_cache) if with_cache else None


def forward(cfg: config_lib.ModelConfig, tokens: jax.Array,
            segment_ids: Optional[jax.Array] = None,
            positions: Optional[jax.Array] = None, *,
            return_aux: bool = False, cache: Optional[Cache] = None,
            max_len: Optional[int] = None) -> Any:
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
  if with_cache and return_aux:
    raise ValueError("return_aux is for training mode (no cache).")
  segment_ids, positions = _check_inputs(cfg, tokens, segment_ids,
                                         positions, cache is not None)
  pdt = jnp.dtype(cfg.param_dtype)
  emb_WD, head = embedding_and_head(cfg)
  emb_BTD = embed(cfg, emb_WD, tokens)
  x_BTD, loads, cache = decoder_stack(cfg, emb_BTD, segment_ids, positions,
                                      cache=cache, max_len=max_len)
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
    aux["expert_load"] = jnp.stack(loads)
  if mtp_logits:
    aux["mtp_logits"] = jnp.stack(mtp_logits)
  return (logits_BTW, aux) if return_aux else logits_BTW


def build(model_config: Any) -> hk.Transformed:
  """Builds the model.

  Args:
    model_config: the `model` section: a ConfigDict or dict (see
      `configs/ling3_tiny.py`) or a `kda_lm.config.ModelConfig`.

  Returns:
    An `hk.Transformed` without apply rng: `init(rng, tokens,
    segment_ids=None, positions=None)` and `apply(params, tokens,
    segment_ids=None, positions=None, return_aux=False) -> float32 logits
    [B,T,W]` (or `(logits, aux)`, see `forward`). MoE selection biases
    are parameters that gradients never reach (`router_bias_modules` lists
    their modules; `kda_lm.layers.moe.update_selection_biases` moves them).

  Raises:
    ValueError: an invalid config (see `kda_lm.config.ModelConfig`).
  """
  cfg = config_lib.ModelConfig.from_config(model_config)

  def fn(tokens, segment_ids=None, positions=None, return_aux=False,
         cache=None, max_len=None):
    return forward(cfg, tokens, segment_ids, positions,
                   return_aux=return_aux, cache=cache, max_len=max_len)

  return hk.without_apply_rng(hk.transform(fn))


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
                         output_gate=cfg.mla_output_gate)


def _ffn_param_count(cfg: config_lib.ModelConfig, use_moe: bool) -> int:
  D = cfg.d_model
  if not use_moe:
    return 3 * D * cfg.mlp_hidden_dim
  return moe.param_count(D, cfg.num_experts, cfg.moe_intermediate_size,
                         cfg.num_shared_experts)


def param_count(model_config: Any) -> int:
  """Parameter count by shape arithmetic (checks `init` in tests)."""
  cfg = config_lib.ModelConfig.from_config(model_config)
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


def router_bias_modules(model_config: Any) -> list[str]:
  """Module paths of the MoE layers, in the order of `aux["expert_load"]`."""
  cfg = config_lib.ModelConfig.from_config(model_config)
  paths = [f"layer_{i}/moe" for i in range(len(cfg.attention_pattern))
           if cfg.is_moe_layer(i)]
  if cfg.num_experts:
    paths += [f"mtp_{k}/block/moe" for k in range(cfg.num_mtp_layers)]
  return paths


def abstract_params(model_config: Any, seq_len: int = 8) -> hk.Params:
  """Parameter shapes and dtypes (`jax.ShapeDtypeStruct`s), nothing run."""
  model = build(model_config)
  tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
  return jax.eval_shape(model.init, jax.random.key(0), tokens)


def summary(model_config: Any, *, shapes: bool = True) -> str:
  """A parameter table: one row per top-level layer, then per parameter.

  Args:
    model_config: the `model` config dict.
    shapes: append a table of every parameter's shape.

  Returns:
    The table as text.
  """
  cfg = config_lib.ModelConfig.from_config(model_config)
  params = abstract_params(model_config)
  rows = {}
  for module, _, p in hk.data_structures.traverse(params):
    top = module.split("/")[0]
    rows.setdefault(top, 0)
    rows[top] += int(np.prod(p.shape))
  gate = cfg.kda_gate

  def kind(top):
    if top.startswith("layer_"):
      i = int(top.split("_")[1])
      c = cfg.attention_pattern[i]
      ffn = "MoE" if cfg.is_moe_layer(i) else "SwiGLU"
      return f"KDA ({gate}) + {ffn}" if c == "K" else f"MLA + {ffn}"
    if top.startswith("mtp_"):
      return "MTP"
    return {"embed": "embedding" + (" (tied head)" if cfg.tie_embeddings
                                    else ""),
            "final_norm": "RMSNorm", "lm_head": "linear"}.get(top, "?")

  order = (["embed"] + [f"layer_{i}" for i in
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
  print(summary(_CONFIG.value.model, shapes=_SHAPES.value))


if __name__ == "__main__":
  from absl import app, flags
  from ml_collections import config_flags

  _CONFIG = config_flags.DEFINE_config_file(
      "config", None, "Config file with a `model` dict.", lock_config=True)
  _SHAPES = flags.DEFINE_bool("shapes", True,
                              "Also list every parameter's shape.")
  flags.mark_flags_as_required(["config"])
  app.run(_main)
