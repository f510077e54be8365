r"""Compile time against depth, scanned and unscanned.

Compiles (for this host's CPU) one full training step of Ling-3.0-tiny's
layer pattern at `--layers` depths, with and without
`model.scan_layers`, and prints the compile time, wall and CPU seconds of
this process (CPU seconds are robust to a busy machine; the wall time is
not). The widths are cut (`--d_model`, heads, experts) so that a 2-core
host compiles the unscanned 24 layers in minutes: what grows with depth is
the number of layer copies in the program, not their width.

  python -m experiments.bench_compile_depth --layers=8,24
"""

import time

from absl import app, flags
import jax
import jax.numpy as jnp

from configs import ling3
import kda_lm  # noqa: F401  (XLA:CPU flags)
from kda_lm import config as config_lib
from kda_lm import model as model_lib
from kda_lm import optimizer
from kda_lm.train import state as state_lib
from kda_lm.train import step as step_lib

_LAYERS = flags.DEFINE_list("layers", ["8", "24"], "Depths to compile.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "T, tokens per row.")
_D_MODEL = flags.DEFINE_integer("d_model", 256, "D (cut from 1536).")


def small_tiny(layers: int, scan: bool):
  """Ling-3.0-tiny's pattern and MoE layout, cut in width."""
  m = ling3.model_config("tiny")
  m.attention_pattern = m.attention_pattern[:layers - 1] + "M"
  m.update(dict(d_model=_D_MODEL.value, num_heads=4, head_dim=32,
                q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                qk_rope_head_dim=16, v_head_dim=32, mlp_hidden_dim=512,
                num_experts=16, moe_intermediate_size=64, n_group=4,
                topk_group=2, num_experts_per_tok=4, vocab_size=1024,
                compute_dtype="float32", kda_impl="xla", moe_impl="xla",
                scan_layers=scan))
  return config_lib.ModelConfig.from_config(m)


def compile_seconds(m, T: int) -> tuple[float, float]:
  """(wall, CPU) seconds to lower and compile one training step."""
  model = model_lib.build(m)
  tx, schedule = optimizer.make_optimizer(ling3.get_config().opt, 100)
  init = state_lib.make_init_fn(model, tx, T)
  state = jax.eval_shape(init, jax.random.PRNGKey(0))
  tok = jax.ShapeDtypeStruct((2, T), jnp.int32)
  batch = dict(inputs=tok, targets=tok, segment_ids=tok, positions=tok,
               loss_mask=jax.ShapeDtypeStruct((2, T), jnp.float32))
  update = jax.jit(step_lib.make_update_fn(model, tx, schedule, m))
  wall, cpu = time.perf_counter(), time.process_time()
  update.lower(state, batch).compile()
  return time.perf_counter() - wall, time.process_time() - cpu


def main(argv):
  del argv
  print(f"jax {jax.__version__}; Ling-3.0-tiny pattern, d_model "
        f"{_D_MODEL.value}, T={_SEQ_LEN.value}, one training step on CPU")
  print("| layers | scan_layers | compile wall s | compile CPU s |")
  print("|---|---|---|---|", flush=True)
  for layers in (int(x) for x in _LAYERS.value):
    for scan in (False, True):
      wall, cpu = compile_seconds(small_tiny(layers, scan), _SEQ_LEN.value)
      print(f"| {layers} | {scan} | {wall:.1f} | {cpu:.1f} |", flush=True)


if __name__ == "__main__":
  app.run(main)
