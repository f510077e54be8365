r"""The hybrid Ling 3.0 / Kimi Linear style decoder (KDA + MLA), in Haiku.

Shape glossary: B batch rows, T tokens per row, D model width, F MLP width,
H heads, K key head dim, V value head dim (and vocabulary size in
`logits [B,T,V]`).

  x = embed(tokens)                                       [B,T,D]
  for each character c of `attention_pattern` (K = KDA, M = MLA):
    x = x + mixer_c(RMSNorm(x), segment_ids, positions)
    x = x + SwiGLU(RMSNorm(x))
  logits = LM head(RMSNorm(x))                            [B,T,V] float32

`segment_ids [B,T]` (1-based documents, 0 = padding) reach every KDA layer
(state and short-conv resets) and every MLA layer (mask); positions restart
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

from kda_lm import segments
from kda_lm.layers import kda, linear, mla, mlp, moe, mtp, norm
from kda_lm.ops.kda import api as kda_api

LAYER_KINDS = {"K": "kda", "M": "mla"}
DTYPES = ("float32", "bfloat16", "float16")

# Defaults of the optional model config keys.
_DEFAULTS = dict(
    kda_head_v_dim=None, mla_num_heads=None, conv_bias=False, norm_eps=1e-6,
    embed_init_std=None, param_dtype="float32", compute_dtype="float32",
    kda_impl="auto", kda_chunk_size=64, kda_gate="ling", conv_size=4,
    q_lora_rank=0, rope_theta=10000.0, use_nope=False, mla_output_gate=False,
    tie_embeddings=False,
    # Mixture of experts (kda_lm/layers/moe.py); num_experts 0 = dense.
    num_experts=0, num_experts_per_tok=1, num_shared_experts=0,
    moe_intermediate_size=None, first_k_dense_replace=0,
    routed_scaling_factor=1.0, n_group=1, topk_group=1,
    router_bias_update_rate=1e-3,
    # Multi-token prediction (kda_lm/layers/mtp.py); 0 = none.
    num_mtp_layers=0, mtp_loss_scale=0.1, mtp_layer_kind="M")
_REQUIRED = ("vocab_size", "d_model", "attention_pattern", "num_heads",
             "head_dim", "kv_lora_rank", "qk_nope_head_dim",
             "qk_rope_head_dim", "v_head_dim", "mlp_hidden_dim")


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


def _get(config: Any, key: str) -> Any:
  """Reads `config[key]` (ConfigDict or mapping), else the default."""
  if key in config:
    value = config[key]
    # An unset ml_collections.FieldReference reads as None.
    return _DEFAULTS.get(key) if value is None else value
  if key in _REQUIRED:
    raise ValueError(f"model config lacks the required key {key!r}.")
  return _DEFAULTS[key]


def _positive_int(key: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or (
      value < 1):
    raise ValueError(f"model.{key} must be a positive int, got {value!r}.")
  return int(value)


def resolve_config(model_config: Any) -> dict[str, Any]:
  """Validates a model config and returns it as a plain dict with defaults.

  Args:
    model_config: an `ml_collections.ConfigDict` (or mapping) with the keys
      of `configs/ling3_tiny.py`'s `model` dict.

  Returns:
    A dict of every model key, optional ones filled in.

  Raises:
    ValueError: a missing key, an empty or invalid `attention_pattern`, an
      inconsistent head dimension or an unknown gate, impl or dtype.
  """
  cfg = {key: _get(model_config, key)
         for key in (*_REQUIRED, *_DEFAULTS)}
  pattern = cfg["attention_pattern"]
  if not isinstance(pattern, str) or not pattern:
    raise ValueError(f"model.attention_pattern must be a non-empty string of "
                     f"{sorted(LAYER_KINDS)}, got {pattern!r}.")
  bad = sorted(set(pattern) - set(LAYER_KINDS))
  if bad:
    raise ValueError(f"model.attention_pattern {pattern!r} has invalid "
                     f"characters {bad}; use 'K' (KDA) and 'M' (MLA).")
  for key in ("vocab_size", "d_model", "num_heads", "head_dim",
              "mlp_hidden_dim", "conv_size", "kda_chunk_size"):
    cfg[key] = _positive_int(key, cfg[key])
  for key in ("kda_head_v_dim", "mla_num_heads"):
    if cfg[key] is not None:
      cfg[key] = _positive_int(key, cfg[key])
  cfg["kda_head_v_dim"] = cfg["kda_head_v_dim"] or cfg["head_dim"]
  cfg["mla_num_heads"] = cfg["mla_num_heads"] or cfg["num_heads"]
  if cfg["kda_gate"] not in kda.GATES:
    raise ValueError(f"model.kda_gate must be one of {kda.GATES}, got "
                     f"{cfg['kda_gate']!r}.")
  kda_api.resolve_impl(cfg["kda_impl"])
  mla.check_dims(num_heads=cfg["mla_num_heads"],
                 q_lora_rank=cfg["q_lora_rank"],
                 kv_lora_rank=cfg["kv_lora_rank"],
                 qk_nope_head_dim=cfg["qk_nope_head_dim"],
                 qk_rope_head_dim=cfg["qk_rope_head_dim"],
                 v_head_dim=cfg["v_head_dim"], use_nope=cfg["use_nope"])
  for key in ("param_dtype", "compute_dtype"):
    if cfg[key] not in DTYPES:
      raise ValueError(f"model.{key} must be one of {DTYPES}, got "
                       f"{cfg[key]!r}.")
  if cfg["embed_init_std"] is None:
    cfg["embed_init_std"] = (cfg["d_model"] ** -0.5 if cfg["tie_embeddings"]
                             else 1.0)
  if not cfg["embed_init_std"] > 0 or not cfg["rope_theta"] > 0 or not (
      cfg["norm_eps"] > 0):
    raise ValueError("model.embed_init_std, rope_theta and norm_eps must be "
                     "positive.")
  for key in ("num_experts", "num_shared_experts", "first_k_dense_replace",
              "num_mtp_layers"):
    if isinstance(cfg[key], bool) or not isinstance(
        cfg[key], (int, np.integer)) or cfg[key] < 0:
      raise ValueError(f"model.{key} must be an int >= 0, got "
                       f"{cfg[key]!r}.")
    cfg[key] = int(cfg[key])
  if cfg["num_experts"]:
    if cfg["moe_intermediate_size"] is not None:
      cfg["moe_intermediate_size"] = _positive_int(
          "moe_intermediate_size", cfg["moe_intermediate_size"])
    cfg["moe_intermediate_size"] = (cfg["moe_intermediate_size"]
                                    or cfg["mlp_hidden_dim"])
    for key in ("num_experts_per_tok", "n_group", "topk_group"):
      cfg[key] = _positive_int(key, cfg[key])
    moe.check_dims(num_experts=cfg["num_experts"],
                   num_experts_per_tok=cfg["num_experts_per_tok"],
                   n_group=cfg["n_group"], topk_group=cfg["topk_group"])
  if cfg["mtp_layer_kind"] not in LAYER_KINDS:
    raise ValueError(f"model.mtp_layer_kind must be one of "
                     f"{sorted(LAYER_KINDS)}, got {cfg['mtp_layer_kind']!r}.")
  if not cfg["router_bias_update_rate"] >= 0 or not (
      cfg["mtp_loss_scale"] >= 0):
    raise ValueError("model.router_bias_update_rate and mtp_loss_scale must "
                     "be >= 0.")
  return cfg


def is_moe_layer(cfg: dict[str, Any], i: int) -> bool:
  """Whether decoder layer `i` (0-based) has a MoE feed-forward."""
  return bool(cfg["num_experts"]) and i >= cfg["first_k_dense_replace"]


class DecoderBlock(hk.Module):
  """Pre-norm block: `x + mixer(norm(x))`, then `x + FFN(norm(x))`.

  FFN is a dense SwiGLU, or with `use_moe` the MoE of
  `kda_lm/layers/moe.py`.
  """

  def __init__(self, kind: str, cfg: dict[str, Any], use_moe: bool = False,
               name: Optional[str] = None):
    """Initialises the module.

    Args:
      kind: "K" (KDA) or "M" (MLA).
      cfg: a resolved model config (`resolve_config`).
      use_moe: a MoE feed-forward instead of the dense SwiGLU.
      name: module name.
    """
    super().__init__(name=name)
    self.kind = kind
    self.cfg = cfg
    self.use_moe = use_moe

  def __call__(self, x: jax.Array, segment_ids: Optional[jax.Array],
               positions: jax.Array
               ) -> tuple[jax.Array, Optional[jax.Array]]:
    """Maps `x [B,T,D]` to (`[B,T,D]`, expert load [E] or None)."""
    cfg = self.cfg
    pdt = jnp.dtype(cfg["param_dtype"])
    eps = cfg["norm_eps"]
    h = norm.RMSNorm(eps, pdt, name="attn_norm")(x)
    if self.kind == "K":
      h = kda.KimiDeltaAttention(
          cfg["num_heads"], cfg["head_dim"], head_v_dim=cfg["kda_head_v_dim"],
          gate=cfg["kda_gate"], conv_size=cfg["conv_size"],
          conv_bias=cfg["conv_bias"], norm_eps=eps, impl=cfg["kda_impl"],
          chunk_size=cfg["kda_chunk_size"], param_dtype=pdt, name="kda")(
              h, segment_ids)
    else:
      h = mla.MultiHeadLatentAttention(
          cfg["mla_num_heads"], q_lora_rank=cfg["q_lora_rank"],
          kv_lora_rank=cfg["kv_lora_rank"],
          qk_nope_head_dim=cfg["qk_nope_head_dim"],
          qk_rope_head_dim=cfg["qk_rope_head_dim"],
          v_head_dim=cfg["v_head_dim"], rope_theta=cfg["rope_theta"],
          use_nope=cfg["use_nope"], output_gate=cfg["mla_output_gate"],
          norm_eps=eps, param_dtype=pdt, name="mla")(
              h, segment_ids, positions)
    x = x + h
    h = norm.RMSNorm(eps, pdt, name="mlp_norm")(x)
    if not self.use_moe:
      return x + mlp.SwiGLU(cfg["mlp_hidden_dim"], param_dtype=pdt,
                            name="mlp")(h), None
    h, load = moe.MoE(
        cfg["num_experts"], cfg["num_experts_per_tok"],
        cfg["moe_intermediate_size"],
        num_shared_experts=cfg["num_shared_experts"],
        routed_scaling_factor=cfg["routed_scaling_factor"],
        n_group=cfg["n_group"], topk_group=cfg["topk_group"],
        param_dtype=pdt, name="moe")(
            h, None if segment_ids is None else segment_ids != 0)
    return x + h, load


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


def check_tokens(tokens: Any, vocab_size: int) -> None:
  """Raises if concrete `tokens` hold ids outside `[0, vocab_size)`.

  Call it where tokens are concrete (the data pipeline, the training entry):
  the embedding lookup cannot raise under `jit`. Tracers are skipped.

  Raises:
    ValueError: an id out of range.
  """
  try:
    ids = np.asarray(tokens)
  except (jax.errors.TracerArrayConversionError,
          jax.errors.ConcretizationTypeError):
    return
  if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
    raise ValueError(f"token ids must lie in [0, {vocab_size}), found "
                     f"[{ids.min()}, {ids.max()}].")


def forward(cfg: dict[str, Any], tokens: jax.Array,
            segment_ids: Optional[jax.Array] = None,
            positions: Optional[jax.Array] = None, *,
            return_aux: bool = False) -> Any:
  """The decoder; call inside `hk.transform` (see `build`).

  Args:
    cfg: a resolved model config (`resolve_config`).
    tokens: [B,T] int token ids in `[0, vocab_size)`.
    segment_ids: optional [B,T] int, 1-based document ids, 0 = padding.
      None = one document per row.
    positions: optional [B,T] int RoPE positions. None = derived from
      `segment_ids` (0 at each document start, 0 on padding), or 0..T-1.

    return_aux: also return a dict of auxiliary outputs.

  Returns:
    [B,T,vocab_size] float32 logits (padding rows hold finite garbage); with
    `return_aux`, `(logits, aux)` where `aux` may hold `expert_load`
    [MoE layers, E] float32 (tokens routed to each expert, padding not
    counted; MTP blocks' MoE layers last) and `mtp_logits`
    [num_mtp_layers, B,T,vocab] float32 (layer k-1 predicts t_{i+k+1}).

  Raises:
    ValueError: a malformed `tokens`, or `segment_ids`/`positions` whose
      shape differs from `tokens`; concrete token ids out of range.
  """
  _check_int_array("tokens", tokens, None)
  shape = tuple(tokens.shape)
  if segment_ids is not None:
    _check_int_array("segment_ids", segment_ids, shape)
    segment_ids = segment_ids.astype(jnp.int32)
  if positions is not None:
    _check_int_array("positions", positions, shape)
  check_tokens(tokens, cfg["vocab_size"])
  B, T = shape
  if positions is None:
    positions = (jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
                 if segment_ids is None else
                 segments.positions_from_segment_ids(segment_ids))
  positions = positions.astype(jnp.int32)

  pdt = jnp.dtype(cfg["param_dtype"])
  cdt = jnp.dtype(cfg["compute_dtype"])
  D, vocab = cfg["d_model"], cfg["vocab_size"]
  with hk.name_scope("embed"):
    emb_VD = hk.get_parameter(
        "embeddings", [vocab, D], pdt,
        init=hk.initializers.TruncatedNormal(cfg["embed_init_std"]))
  # Under jit an out-of-range id (negative ones included, which `take` would
  # wrap) reads NaN instead of being clipped to a valid row.
  ids = jnp.where(tokens < 0, vocab, tokens)
  x_BTD = jnp.take(emb_VD, ids, axis=0, mode="fill").astype(cdt)
  emb_BTD = x_BTD
  loads = []
  for i, kind in enumerate(cfg["attention_pattern"]):
    x_BTD, load = DecoderBlock(kind, cfg, is_moe_layer(cfg, i),
                               name=f"layer_{i}")(
                                   x_BTD, segment_ids, positions)
    if load is not None:
      loads.append(load)
  h_BTD = x_BTD
  if cfg["tie_embeddings"]:
    head = lambda y: jnp.einsum("btd,vd->btv", y, emb_VD.astype(cdt),
                                preferred_element_type=jnp.float32)
  else:
    head = linear.Dense(vocab, param_dtype=pdt, out_dtype=jnp.float32,
                        name="lm_head")
  logits = head(norm.RMSNorm(cfg["norm_eps"], pdt, name="final_norm")(x_BTD))
  if not return_aux and not (cfg["num_mtp_layers"] and hk.running_init()):
    return logits
  aux = {}
  mtp_logits = []
  for k in range(1, cfg["num_mtp_layers"] + 1):
    # Layer k reads t_{i+k}; zeroed outside position i's document.
    same = segments.same_segment_ahead(segment_ids, k, shape)
    e_BTD = jnp.where(same[..., None], mtp.shift_left(emb_BTD, k),
                      0).astype(cdt)
    with hk.name_scope(f"mtp_{k - 1}"):
      h_BTD = mtp.MTPInput(cfg["norm_eps"], pdt, name="input")(e_BTD, h_BTD)
      h_BTD, load = DecoderBlock(cfg["mtp_layer_kind"], cfg,
                                 bool(cfg["num_experts"]), name="block")(
                                     h_BTD, segment_ids, positions)
      if load is not None:
        loads.append(load)
      mtp_logits.append(head(norm.RMSNorm(cfg["norm_eps"], pdt,
                                          name="final_norm")(h_BTD)))
  if loads:
    aux["expert_load"] = jnp.stack(loads)
  if mtp_logits:
    aux["mtp_logits"] = jnp.stack(mtp_logits)
  if not return_aux:
    return logits
  return logits, aux


def build(model_config: Any) -> hk.Transformed:
  """Builds the model.

  Args:
    model_config: the `model` config dict (see `configs/ling3_tiny.py`).

  Returns:
    An `hk.Transformed` without apply rng: `init(rng, tokens,
    segment_ids=None, positions=None)` and `apply(params, tokens,
    segment_ids=None, positions=None, return_aux=False) -> float32 logits
    [B,T,vocab]` (or `(logits, aux)`, see `forward`). MoE selection biases
    are parameters that gradients never reach (`moe_bias_paths`).

  Raises:
    ValueError: an invalid config (see `resolve_config`).
  """
  cfg = resolve_config(model_config)

  def fn(tokens, segment_ids=None, positions=None, return_aux=False):
    return forward(cfg, tokens, segment_ids, positions,
                   return_aux=return_aux)

  return hk.without_apply_rng(hk.transform(fn))


def weight_decay_mask(params: hk.Params) -> hk.Params:
  """True for parameters to weight-decay: every >= 2-D array except KDA's.

  `A_log`, `dt_bias` (FLA's `_no_weight_decay`), norm weights and biases are
  excluded.
  """
  return hk.data_structures.map(
      lambda module, name, p: name not in ("A_log", "dt_bias") and p.ndim >= 2,
      params)


def _mixer_param_count(cfg: dict[str, Any], kind: str) -> int:
  D = cfg["d_model"]
  if kind == "K":
    return kda.param_count(D, cfg["num_heads"], cfg["head_dim"],
                           head_v_dim=cfg["kda_head_v_dim"],
                           gate=cfg["kda_gate"], conv_size=cfg["conv_size"],
                           conv_bias=cfg["conv_bias"])
  return mla.param_count(D, cfg["mla_num_heads"],
                         q_lora_rank=cfg["q_lora_rank"],
                         kv_lora_rank=cfg["kv_lora_rank"],
                         qk_nope_head_dim=cfg["qk_nope_head_dim"],
                         qk_rope_head_dim=cfg["qk_rope_head_dim"],
                         v_head_dim=cfg["v_head_dim"],
                         output_gate=cfg["mla_output_gate"])


def _ffn_param_count(cfg: dict[str, Any], use_moe: bool) -> int:
  D = cfg["d_model"]
  if not use_moe:
    return 3 * D * cfg["mlp_hidden_dim"]
  return moe.param_count(D, cfg["num_experts"], cfg["moe_intermediate_size"],
                         cfg["num_shared_experts"])


def param_count(model_config: Any) -> int:
  """Parameter count by shape arithmetic (checks `init` in tests)."""
  cfg = resolve_config(model_config)
  D = cfg["d_model"]
  n = cfg["vocab_size"] * D + D                      # embedding, final norm
  if not cfg["tie_embeddings"]:
    n += D * cfg["vocab_size"]
  for i, kind in enumerate(cfg["attention_pattern"]):
    n += 2 * D + _mixer_param_count(cfg, kind)       # two norms, mixer
    n += _ffn_param_count(cfg, is_moe_layer(cfg, i))
  kind = cfg["mtp_layer_kind"]
  n += cfg["num_mtp_layers"] * (
      2 * D + 2 * D * D                              # enorm, hnorm, eh_proj
      + 2 * D + _mixer_param_count(cfg, kind)
      + _ffn_param_count(cfg, bool(cfg["num_experts"]))
      + D)                                           # MTP final norm
  return n


def router_bias_modules(model_config: Any) -> list[str]:
  """Module paths of the MoE layers, in the order of `aux["expert_load"]`."""
  cfg = resolve_config(model_config)
  paths = [f"layer_{i}/moe" for i in range(len(cfg["attention_pattern"]))
           if is_moe_layer(cfg, i)]
  if cfg["num_experts"]:
    paths += [f"mtp_{k}/block/moe" for k in range(cfg["num_mtp_layers"])]
  return paths


def update_router_bias(params: hk.Params, expert_load: jax.Array,
                       modules: list[str], rate: float) -> hk.Params:
  """Moves each MoE layer's selection bias toward a uniform load.

  Args:
    params: the parameters (not modified).
    expert_load: [len(modules), E] tokens per expert (`aux["expert_load"]`).
    modules: `router_bias_modules(model_config)`.
    rate: `model.router_bias_update_rate`.

  Returns:
    `params` with every `<module>/e_score_correction_bias` replaced by
    `bias + rate * sign(mean(load) - load)`.
  """
  new = dict(params)
  for row, module in enumerate(modules):
    entry = dict(new[module])
    entry[moe.BIAS_NAME] = moe.update_bias(entry[moe.BIAS_NAME],
                                           expert_load[row], rate)
    new[module] = entry
  return type(params)(new) if isinstance(params, dict) else new


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
  cfg = resolve_config(model_config)
  params = abstract_params(model_config)
  rows = {}
  for module, _, p in hk.data_structures.traverse(params):
    top = module.split("/")[0]
    rows.setdefault(top, 0)
    rows[top] += int(np.prod(p.shape))
  gate = cfg["kda_gate"]

  def kind(top):
    if top.startswith("layer_"):
      i = int(top.split("_")[1])
      c = cfg["attention_pattern"][i]
      ffn = "MoE" if is_moe_layer(cfg, i) else "SwiGLU"
      return f"KDA ({gate}) + {ffn}" if c == "K" else f"MLA + {ffn}"
    if top.startswith("mtp_"):
      return "MTP"
    return {"embed": "embedding" + (" (tied head)" if cfg["tie_embeddings"]
                                    else ""),
            "final_norm": "RMSNorm", "lm_head": "linear"}.get(top, "?")

  order = (["embed"] + [f"layer_{i}" for i in
                        range(len(cfg["attention_pattern"]))]
           + ["final_norm", "lm_head"]
           + [f"mtp_{k}" for k in range(cfg["num_mtp_layers"])])
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
