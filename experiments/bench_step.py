r"""Benchmarks one training step on the present device, and its parts.

Builds a model of Ling-3.0-tiny's (or Kimi-Linear-48B's) widths cut to
`--layers` layers of its pattern, with `--experts` routed experts of which
`--top_k` per token, and times one jitted training step (forward,
gradient, AdamW, donation) at B x T tokens after a warm-up: compile
seconds, step ms (median of `--repeats`), tokens/s, TFLOP/s per device
(`kda_lm.flops.step_flops`), MFU against the device's bf16 peak
(`flops.peak_flops`) and against the same run's 8192^3 (CPU: 2048^3)
bfloat16 matmul rate, and peak memory.

With `--parts`, it also times each part alone, forward and backward, on
the same shapes and with the same implementations:
- the embedding with the final norm, the LM head and the loss;
- each layer's mixer (KDA, MLA) and feed-forward (MoE, dense SwiGLU),
  times the number of such layers;
- the AdamW update of all parameters.

Their sum beside the whole step tells how much the parts overlap or leave
out (fusions across parts, the scan, the MoE bias update).

With `--config=configs/ling3_tiny.py[:variant]` the step is that training
config's instead (its model, batch, row length, loss pieces, remat and
optimizer), so that its figure can be set beside the MFU that
`python train.py` logs for the same config.

  python -m experiments.bench_step                       # 4-layer tiny step
  python -m experiments.bench_step --kda_impl=xla --parts
  python -m experiments.bench_step --layers=2 --seq_len=256 --experts=4 \
      --top_k=2 --parts                                   # seconds on a CPU
"""

import dataclasses
import json
import statistics
import time
from typing import Any

from absl import app, flags
import haiku as hk
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np
import optax

from configs import ling3
from experiments import compile_mesh
from kda_lm import config as config_lib
from kda_lm import flops, losses, optimizer
from kda_lm import model as model_lib
from kda_lm.layers import block, norm
from kda_lm.train import state as state_lib
from kda_lm.train import step as step_lib
from testbed import profile_summary, timing

_MODEL = flags.DEFINE_string("model", "tiny", "Widths: tiny, kimi.")
_LAYERS = flags.DEFINE_integer("layers", 4, "Layers of the pattern.")
_EXPERTS = flags.DEFINE_integer("experts", 16, "Routed experts.")
_TOP_K = flags.DEFINE_integer("top_k", 8, "Experts per token.")
_B = flags.DEFINE_integer("batch", 1, "Rows per step.")
_T = flags.DEFINE_integer("seq_len", 4096, "Tokens per row.")
_REMAT = flags.DEFINE_string("remat", "none", "config.train.remat.")
_SCAN = flags.DEFINE_bool("scan_layers", True, "model.scan_layers.")
_CHUNKS = flags.DEFINE_integer("loss_chunks", 8, "config.train.loss_chunks.")
_MOMENTS = flags.DEFINE_string("moment_dtype", "float32",
                               "config.opt.moment_dtype.")
_KDA = flags.DEFINE_string("kda_impl", "auto", "model.kda_impl.")
_MOE = flags.DEFINE_string("moe_impl", "auto", "model.moe_impl.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed steps (median).")
_PARTS = flags.DEFINE_bool("parts", False, "Also time each part alone.")
_PROFILE = flags.DEFINE_bool(
    "profile", False, "Also profile the step: device time per model part.")
_JSON = flags.DEFINE_string("json", None, "Also write the results here.")
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "A training config file: its step instead of the flags "
    "above.")


@dataclasses.dataclass(frozen=True)
class Setup:
  """What one benchmarked step is: the model, its rows and the training
  options that change the step."""
  model: config_lib.ModelConfig
  B: int
  T: int
  loss_chunks: int
  remat: str
  opt: Any             # a `config.opt` ConfigDict


def setup() -> Setup:
  """The step of `--config`, or of the width flags."""
  c = _CONFIG.value
  if c is not None:
    return Setup(config_lib.ModelConfig.from_config(c.model),
                 c.data.batch_size, c.data.seq_len, c.train.loss_chunks,
                 c.train.remat, c.opt)
  opt = ling3.get_config().opt
  opt.moment_dtype = _MOMENTS.value
  return Setup(config_lib.ModelConfig.from_config(model_config()), _B.value,
               _T.value, _CHUNKS.value, _REMAT.value, opt)


def model_config():
  """The width flags' `model` ConfigDict."""
  m = compile_mesh.model_config(_LAYERS.value, _MODEL.value)
  m.num_experts, m.num_experts_per_tok = _EXPERTS.value, _TOP_K.value
  if m.num_experts % m.n_group or m.num_experts_per_tok > (
      m.num_experts // m.n_group * m.topk_group):
    m.n_group = m.topk_group = 1    # Group-limited routing does not fit.
  m.kda_impl, m.moe_impl = _KDA.value, _MOE.value
  m.compute_dtype = "bfloat16"
  m.scan_layers = _SCAN.value
  return m


def timed(fn, args, repeats):
  """(median seconds, compile seconds) of a jitted `fn` on `args`."""
  start = time.perf_counter()
  compiled = fn.lower(*args).compile()
  compile_s = time.perf_counter() - start
  return timing.median_seconds(compiled, args, repeats), compile_s


def matmul_rate():
  return timing.matmul_rate(8192 if jax.default_backend() != "cpu" else 2048)


def batch_for(B, T, vocab):
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, vocab, (B, T)), jnp.int32)
  seg = jnp.asarray(np.broadcast_to(1 + np.arange(T) // 2048, (B, T)),
                    jnp.int32)
  pos = jnp.asarray(np.broadcast_to(np.arange(T) % 2048, (B, T)), jnp.int32)
  return dict(inputs=tokens, targets=tokens, segment_ids=seg, positions=pos,
              loss_mask=jnp.ones((B, T), jnp.float32))


def whole_step(su: Setup):
  """The jitted update and its (state, batch); returns a dict of results."""
  m, B, T = su.model, su.B, su.T
  model = model_lib.build(m, remat=su.remat)
  tx, schedule = optimizer.make_optimizer(su.opt, 100)
  state = jax.jit(state_lib.make_init_fn(model, tx, T))(jax.random.key(0))
  batch = batch_for(B, T, m.vocab_size)
  update = jax.jit(step_lib.make_update_fn(model, tx, schedule, m, 1,
                                           su.loss_chunks), donate_argnums=0)
  start = time.perf_counter()
  lowered = update.lower(state, batch)
  lower_s = time.perf_counter() - start
  compiled = lowered.compile()
  compile_s = time.perf_counter() - start - lower_s
  state, _ = compiled(state, batch)
  jax.block_until_ready(state)
  times = []
  for _ in range(_REPEATS.value):
    t = time.perf_counter()
    state, _ = compiled(state, batch)
    jax.block_until_ready(state)
    times.append(time.perf_counter() - t)
  mem = jax.devices()[0].memory_stats() or {}
  out = dict(step_s=statistics.median(times), compile_s=compile_s,
             lower_s=lower_s,
             peak_bytes=mem.get("peak_bytes_in_use"), tx=tx)
  if _PROFILE.value:
    out["profile"], (state, _) = profile_summary.profile(
        compiled, (state, batch), rerun=lambda o, a: (o[0], a[1]))
  out["params"] = state.params
  return out


def _grad_time(fn, params, *inputs):
  """Forward+backward seconds of a Haiku function's scalar loss."""
  loss = lambda p, *x: jnp.sum(fn.apply(p, None, *x).astype(jnp.float32))
  wrt = (0,) + tuple(i + 1 for i, a in enumerate(inputs)
                     if jnp.issubdtype(a.dtype, jnp.inexact))
  grad = jax.jit(jax.grad(loss, argnums=wrt))
  return timed(grad, (params,) + inputs, _REPEATS.value)[0]


def part_times(su: Setup, params, tx):
  """{part: seconds} of each part alone (times its count of layers)."""
  cfg, B, T = su.model, su.B, su.T
  batch = batch_for(B, T, cfg.vocab_size)
  seg, pos = batch["segment_ids"], batch["positions"]
  x = jnp.asarray(np.random.default_rng(1).standard_normal(
      (B, T, cfg.d_model)), jnp.bfloat16)
  out = {}
  counts = {}
  for i, kind in enumerate(cfg.attention_pattern):
    mixer = "KDA mixer" if kind == "K" else "MLA mixer"
    counts[mixer] = counts.get(mixer, 0) + 1
    ffn = "MoE feed-forward" if cfg.is_moe_layer(i) else "dense feed-forward"
    counts[ffn] = counts.get(ffn, 0) + 1
  for name, count in counts.items():
    if name.endswith("mixer"):
      kind = "K" if name.startswith("KDA") else "M"
      fn = hk.transform(lambda h, s, p, k=kind: block.mixer(k, cfg, h, s, p))
      args = (x, seg, pos)
    else:
      moe = name.startswith("MoE")
      fn = hk.transform(lambda h, s, e=moe: block.ffn(cfg, e, h, s)[0])
      args = (x, seg)
    p = fn.init(jax.random.key(0), *args)
    out[name] = count * _grad_time(fn, p, *args)

  def head_loss(tokens):
    emb = hk.Embed(cfg.vocab_size, cfg.d_model, name="embed")(tokens)
    h = norm.RMSNorm(cfg.norm_eps, jnp.float32, name="final_norm")(
        emb.astype(jnp.bfloat16))
    w = hk.get_parameter("w", [cfg.d_model, cfg.vocab_size], jnp.float32,
                         init=hk.initializers.RandomNormal(0.02))
    loss, _, _ = losses.loss_terms(h, batch, w.astype(jnp.bfloat16),
                                   su.loss_chunks)
    return loss

  fn = hk.transform(head_loss)
  p = fn.init(jax.random.key(0), batch["inputs"])
  out["embedding, head and loss"] = _grad_time(fn, p, batch["inputs"])
  grads = jax.tree.map(jnp.zeros_like, params)
  opt_state = tx.init(params)
  apply = jax.jit(lambda g, s, p: optax.apply_updates(
      p, tx.update(g, s, p)[0]))
  out["AdamW update"] = timed(apply, (grads, opt_state, params),
                              _REPEATS.value)[0]
  return out


def main(argv):
  del argv
  su = setup()
  m, B, T = su.model, su.B, su.T
  device = jax.devices()[0]
  name = (_MODEL.value if _CONFIG.value is None else
          config_flags.get_config_filename(flags.FLAGS["config"]))
  print(f"device: {device.device_kind} x {jax.device_count()}; model "
        f"{name} {m.attention_pattern}, E={m.num_experts} "
        f"top-{m.num_experts_per_tok}, B={B}, T={T}, remat {su.remat}, "
        f"loss in {su.loss_chunks}, kda {m.kda_impl}, moe {m.moe_impl}",
        flush=True)
  rate = matmul_rate()
  r = whole_step(su)
  step_flops = flops.step_flops(m, B, T, r["params"])
  peak = flops.peak_flops(device.device_kind)
  per_device = step_flops / r["step_s"] / jax.device_count()
  rows = [("trace and lower s", f"{r['lower_s']:.1f}"),
          ("compile s", f"{r['compile_s']:.1f}"),
          ("step ms", f"{1e3 * r['step_s']:.1f}"),
          ("tokens/s", f"{B * T / r['step_s']:,.0f}"),
          ("TFLOP/s per device", f"{per_device / 1e12:.3g}"),
          ("MFU of the bf16 peak", f"{100 * per_device / peak:.3g}%"
           if peak else "-"),
          ("of this run's matmul rate", f"{100 * per_device / rate:.3g}%"),
          ("peak memory GiB", f"{r['peak_bytes'] / 2**30:.2f}"
           if r["peak_bytes"] else "-")]
  print("\n| quantity | value |\n| --- | --- |")
  for k, v in rows:
    print(f"| {k} | {v} |")
  result = dict(rows)
  if _PROFILE.value:
    print("\n" + profile_summary.table(r["profile"], r["step_s"]))
    result["profile_ms"] = {p: 1e3 * s for p, s, _ in r["profile"]}
    result["profile_top"] = {p: [(o, ns / 3e6) for o, ns in top]
                             for p, _, top in r["profile"]}
  if _PARTS.value:
    parts = part_times(su, r["params"], r["tx"])
    total = sum(parts.values())
    print("\n| part (forward+backward) | ms | share of the step |\n"
          "| --- | --- | --- |")
    for name, sec in parts.items():
      print(f"| {name} | {1e3 * sec:.1f} | {100 * sec / r['step_s']:.0f}% |")
    print(f"| sum of the parts | {1e3 * total:.1f} | "
          f"{100 * total / r['step_s']:.0f}% |")
    result["parts_ms"] = {k: 1e3 * v for k, v in parts.items()}
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
