"""The decoder block: the pre-norm residual layer the model stacks.

  x = x + mixer(RMSNorm(x))        mixer: KDA (`kda.py`) or MLA (`mla.py`)
  x = x + FFN(RMSNorm(x))          FFN: dense SwiGLU or the MoE (`moe.py`)

The mixer's and the FFN's outputs carry the `checkpoint_name`s MIXER_OUT
and FFN_OUT, which the `save_outputs` rematerialisation policy keeps
(`kda_lm/stack.py`).
"""

from typing import Any, Optional

import haiku as hk
import jax
from jax import ad_checkpoint
import jax.numpy as jnp

from kda_lm.layers import kda, mla, mlp, moe, norm

MIXER_OUT = "mixer_out"
FFN_OUT = "ffn_out"


class DecoderBlock(hk.Module):
  """Pre-norm block: `x + mixer(norm(x))`, then `x + FFN(norm(x))`.

  FFN is a dense SwiGLU, or with `use_moe` the MoE of
  `kda_lm/layers/moe.py`.
  """

  def __init__(self, kind: str, cfg: Any,
               use_moe: bool = False, name: Optional[str] = None, *,
               limits: tuple[float, float] = (0.0, 0.0)):
    """Initialises the module.

    Args:
      kind: "K" (KDA) or "M" (MLA).
      cfg: the model config (`kda_lm.config.ModelConfig`).
      use_moe: a MoE feed-forward instead of the dense SwiGLU.
      name: module name.
      limits: the MoE's (routed, shared) SwiGLU clamps
        (`ModelConfig.swiglu_limits`; 0 = none).
    """
    super().__init__(name=name)
    self.kind = kind
    self.cfg = cfg
    self.use_moe = use_moe
    self.limits = limits

  def __call__(self, x: jax.Array, segment_ids: Optional[jax.Array],
               positions: Optional[jax.Array], *, cache: Any = None,
               max_len: Optional[int] = None) -> tuple[Any, ...]:
    """Maps `x [B,T,D]` to (`[B,T,D]`, expert load [E] or None).

    With a decode `cache` (the mixer's `KDACache` or `MLACache`) or a
    prefill's `max_len` (see `kda_lm.infer.decoding`), returns `(x, load,
    mixer cache)`.
    """
    eps, pdt = self.cfg.norm_eps, jnp.dtype(self.cfg.param_dtype)
    with_cache = cache is not None or max_len is not None
    h = norm.RMSNorm(eps, pdt, name="attn_norm")(x)
    h = mixer(self.kind, self.cfg, h, segment_ids, positions, cache=cache,
              max_len=max_len)
    if with_cache:
      h, cache = h
    x = x + ad_checkpoint.checkpoint_name(h, MIXER_OUT)
    h = norm.RMSNorm(eps, pdt, name="mlp_norm")(x)
    h, load = ffn(self.cfg, self.use_moe, h, segment_ids, self.limits)
    out = x + ad_checkpoint.checkpoint_name(h, FFN_OUT), load
    return out + (cache,) if with_cache else out


def mixer(kind: str, cfg: Any, h: jax.Array,
          segment_ids: Optional[jax.Array], positions: Optional[jax.Array], *,
          cache: Any = None, max_len: Optional[int] = None) -> Any:
  """The mixer ("kda" or "mla" module, in the calling module's scope) on
  normalised `h [B,T,D]` (with a cache or `max_len`, also its cache)."""
  pdt = jnp.dtype(cfg.param_dtype)
  with_cache = cache is not None or max_len is not None
  if kind == "K":
    return kda.KimiDeltaAttention(
        cfg.num_heads, cfg.head_dim, head_v_dim=cfg.kda_head_v_dim,
        gate=cfg.kda_gate, lower_bound=cfg.kda_lower_bound,
        conv_size=cfg.conv_size,
        conv_bias=cfg.conv_bias, norm_eps=cfg.norm_eps, impl=cfg.kda_impl,
        chunk_size=cfg.kda_chunk_size,
        pallas_options=cfg.kda_kernel.options(), param_dtype=pdt,
        name="kda")(
            h, segment_ids, cache=cache, return_cache=with_cache)
  return mla.MultiHeadLatentAttention(
      cfg.mla_num_heads, q_lora_rank=cfg.q_lora_rank,
      kv_lora_rank=cfg.kv_lora_rank,
      qk_nope_head_dim=cfg.qk_nope_head_dim,
      qk_rope_head_dim=cfg.qk_rope_head_dim,
      v_head_dim=cfg.v_head_dim, rope_theta=cfg.rope_theta,
      rope_scaling=cfg.rope_scaling, use_nope=cfg.use_nope,
      output_gate=cfg.mla_output_gate, bias=cfg.mla_bias,
      norm_eps=cfg.mla_norm_eps, param_dtype=pdt, name="mla")(
          h, segment_ids, positions, cache=cache, max_len=max_len)


def ffn(cfg: Any, use_moe: bool, h: jax.Array,
        segment_ids: Optional[jax.Array],
        limits: tuple[float, float] = (0.0, 0.0)
        ) -> tuple[jax.Array, Optional[jax.Array]]:
  """The feed-forward ("mlp" or "moe" module, in the calling module's
  scope) on normalised `h [B,T,D]`: (output, expert load or None); a MoE
  clamps its routed and shared SwiGLUs at `limits`."""
  pdt = jnp.dtype(cfg.param_dtype)
  if not use_moe:
    return mlp.SwiGLU(cfg.mlp_hidden_dim, param_dtype=pdt, name="mlp")(h), (
        None)
  return moe.MoE(
      cfg.num_experts, cfg.num_experts_per_tok,
      cfg.moe_intermediate_size,
      num_shared_experts=cfg.num_shared_experts,
      routed_scaling_factor=cfg.routed_scaling_factor,
      n_group=cfg.n_group, topk_group=cfg.topk_group,
      renormalize=cfg.moe_renormalize, param_dtype=pdt,
      impl=cfg.moe_impl, capacity_factor=cfg.moe_capacity_factor,
      swiglu_limit=limits[0], shared_swiglu_limit=limits[1],
      name="moe")(h, None if segment_ids is None else segment_ids != 0)
