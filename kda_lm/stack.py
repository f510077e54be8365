"""How the decoder's layers run: unrolled or as a scanned group, and what
each layer keeps for the backward pass.

Scanned layers (`config.model.scan_layers`). A Ling 3.0 or Kimi Linear
stack repeats one group of layers (`KKKM`: three KDA layers, then MLA)
after a few irregular leading layers (a dense feed-forward where the rest
are MoE). `layer_plan` finds the group: the layers `[start, start + N*P)`
are N repeats of P slots that agree in mixer kind and feed-forward kind;
they run under one `hk.layer_stack` (`jax.lax.scan`), so the program holds
one copy of the group whatever N is, and compile time stays flat in depth.
The other layers (`head`, `tail`) run unrolled.

Parameter layouts. Unscanned, layer i lives under `layer_{i}/...`.
Scanned, the head and tail layers keep those names and slot j of the group
lives under `scanned/slot_{j}/...` with a leading axis of N (repeat r is
layer `start + r*P + j`). `to_scanned` and `to_unscanned` convert a
parameter tree between the two, exactly (stacking and slicing only).

Rematerialisation (`config.train.remat`), applied per layer (inside the
scan when scanned); what the backward pass may keep of a layer's forward:

  none          everything (no rematerialisation);
  save_dots     the outputs of matmuls with a weight (projections, the
                dense FFN; `jax.checkpoint_policies.
                dots_with_no_batch_dims_saveable`); the KDA chunk
                internals, attention scores, norms and activations are
                recomputed;
  save_outputs  only the mixer's and the feed-forward's outputs
                (`checkpoint_name` "mixer_out" and "ffn_out"), everything
                inside them recomputed;
  full          nothing but the layer's input: the whole layer runs twice.
"""

from typing import Any, Callable, Mapping, NamedTuple, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from kda_lm import config as config_lib
from kda_lm.layers import block

SCAN_NAME = "scanned"
REMAT_POLICIES = config_lib.REMAT_POLICIES
# The names `save_outputs` keeps (`jax.ad_checkpoint.checkpoint_name`).
MIXER_OUT = block.MIXER_OUT
FFN_OUT = block.FFN_OUT


class LayerPlan(NamedTuple):
  """Which layers run unrolled and which as a scanned group.

  Attributes:
    head: layers before the group, unrolled.
    start: the group's first layer.
    period: P, layers per group (slots); 0 = nothing scanned.
    repeats: N, groups scanned.
    tail: layers after the group, unrolled.
  """
  head: tuple[int, ...]
  start: int
  period: int
  repeats: int
  tail: tuple[int, ...]

  def layer(self, r: int, j: int) -> int:
    """The layer index of repeat `r`, slot `j`."""
    return self.start + r * self.period + j

  @property
  def scanned(self) -> range:
    return range(self.start, self.start + self.period * self.repeats)


_LAYER_PREFIX = "layer_"


def layer_name(i: int) -> str:
  """The module of layer i in the unscanned layout: "layer_{i}"."""
  return f"{_LAYER_PREFIX}{i}"


def layer_index(top: str) -> Optional[int]:
  """The inverse of `layer_name`: 12 for "layer_12", None for any other
  module name."""
  if top.startswith(_LAYER_PREFIX) and top[len(_LAYER_PREFIX):].isdigit():
    return int(top[len(_LAYER_PREFIX):])
  return None


def slot_name(j: int) -> str:
  return f"slot_{j}"


def is_stacked(module: str) -> bool:
  """Whether a module's parameters carry the scanned group's leading
  repeat axis (a module under `SCAN_NAME`)."""
  return module.split("/", 1)[0] == SCAN_NAME


def _signature(cfg: config_lib.ModelConfig, i: int) -> tuple:
  """What layers of one scanned slot share: kind, FFN kind, clamps."""
  return cfg.attention_pattern[i], cfg.is_moe_layer(i), cfg.swiglu_limits(i)


def _repeats(sig: list, start: int, period: int) -> int:
  """How many consecutive groups from `start` equal the first one."""
  group, n = sig[start:start + period], 0
  while sig[start + n * period:start + (n + 1) * period] == group:
    n += 1
  return n


def find_group(cfg: config_lib.ModelConfig) -> LayerPlan:
  """The scanned group that leaves the fewest layers unrolled.

  Ties go to the shortest group, then to the fewest trailing layers. A
  stack with no group repeated at least twice is all unrolled.
  """
  L = cfg.num_layers
  sig = [_signature(cfg, i) for i in range(L)]
  best = None
  for period in range(1, L // 2 + 1):
    for start in range(0, L - 2 * period + 1):
      n = _repeats(sig, start, period)
      if n < 2:
        continue
      tail = L - start - n * period
      key = (start + tail, period, tail)
      if best is None or key < best[0]:
        best = key, LayerPlan(tuple(range(start)), start, period, n,
                              tuple(range(start + n * period, L)))
  return best[1] if best else unrolled(cfg)


def unrolled(cfg: config_lib.ModelConfig) -> LayerPlan:
  return LayerPlan(tuple(range(cfg.num_layers)), cfg.num_layers, 0, 0, ())


def layer_plan(cfg: config_lib.ModelConfig) -> LayerPlan:
  """The plan the model runs: `find_group` with `scan_layers`, else all
  layers unrolled."""
  return find_group(cfg) if cfg.scan_layers else unrolled(cfg)


# ---------------------------------------------------------------------------
# Rematerialisation.


check_remat = config_lib.check_remat


def _policy(remat: str) -> Optional[Callable[..., bool]]:
  policies = jax.checkpoint_policies
  return {
      "save_dots": policies.dots_with_no_batch_dims_saveable,
      "save_outputs": policies.save_only_these_names(MIXER_OUT, FFN_OUT),
      "full": policies.nothing_saveable,
  }[remat]


def rematted(fn: Callable[..., Any], remat: str, *, in_scan: bool
             ) -> Callable[..., Any]:
  """`fn` (a layer: arrays in, arrays out) under the `remat` policy."""
  if check_remat(remat) == "none":
    return fn
  return hk.remat(fn, policy=_policy(remat), prevent_cse=not in_scan)


# ---------------------------------------------------------------------------
# Parameter layouts.


def _split_layer(module: str) -> tuple[Optional[int], str]:
  """"layer_12/kda/q_proj" -> (12, "/kda/q_proj"); (None, module) else."""
  top, sep, rest = module.partition("/")
  i = layer_index(top)
  return (None, module) if i is None else (i, sep + rest)


def _stack(leaves: list[Any]) -> Any:
  if all(isinstance(x, np.ndarray) for x in leaves):
    return np.stack(leaves)
  return jnp.stack(leaves)


def to_scanned(params: Mapping[str, Any], cfg: config_lib.ModelConfig
               ) -> dict:
  """An unscanned parameter tree in the scanned layout of `cfg` (its group
  as `find_group` finds it, whatever `scan_layers` says).

  Args:
    params: the parameter tree, unscanned.
    cfg: the model's settings.
  """
  plan = find_group(cfg)
  out, slots = {}, {}
  for module, leaves in params.items():
    i, rest = _split_layer(module)
    if i is None or i not in plan.scanned:
      out[module] = dict(leaves)
      continue
    r, j = divmod(i - plan.start, plan.period)
    slots.setdefault((j, rest), {})[r] = leaves
  for (j, rest), by_repeat in sorted(slots.items()):
    if len(by_repeat) != plan.repeats:
      raise ValueError(f"Parameters of {slot_name(j)}{rest} are missing "
                       f"for some of the {plan.repeats} repeats.")
    first = by_repeat[0]
    out[f"{SCAN_NAME}/{slot_name(j)}{rest}"] = {
        name: _stack([by_repeat[r][name] for r in range(plan.repeats)])
        for name in first}
  return out


def to_unscanned(params: Mapping[str, Any], cfg: config_lib.ModelConfig
                 ) -> dict:
  """The inverse of `to_scanned`.

  Args:
    params: the parameter tree, scanned.
    cfg: the model's settings.
  """
  plan = find_group(cfg)
  out = {}
  prefix = SCAN_NAME + "/"
  for module, leaves in params.items():
    if not module.startswith(prefix):
      out[module] = dict(leaves)
      continue
    slot, sep, rest = module[len(prefix):].partition("/")
    j = int(slot.removeprefix("slot_"))
    for r in range(plan.repeats):
      out[f"{layer_name(plan.layer(r, j))}{sep}{rest}"] = {
          name: value[r] for name, value in leaves.items()}
  return out


def is_scanned(params: Mapping[str, Any]) -> bool:
  """Whether a parameter tree is in the scanned layout."""
  return any(is_stacked(m) for m in params)


def to_layout(params: Mapping[str, Any], cfg: config_lib.ModelConfig
              ) -> dict:
  """`params` in the layout `cfg.scan_layers` asks for.

  Args:
    params: the parameter tree, either layout.
    cfg: the model's settings.
  """
  if is_scanned(params) == cfg.scan_layers:
    return dict(params)
  return (to_scanned if cfg.scan_layers else to_unscanned)(params, cfg)
