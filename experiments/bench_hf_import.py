r"""Host memory of `kda_lm.hf.load_pretrained` on a sharded checkpoint.

Writes a synthetic `bailing_hybrid` checkpoint of a few GiB (random
float32 tensors, Ling-shaped, `--shard_mb` per shard), then loads it in a
fresh process and reports the peak resident memory above the process's
baseline (after imports and JAX start-up) against the size of the output
tree and of the largest shard. The claim checked: the import holds at most
one shard (in fact one tensor) plus the output: peak RSS - output tree
stays below one shard, even with the whole runtime counted in it.

  python -m experiments.bench_hf_import --dir=/tmp/hf_bench --gib=3
"""

import json
import os
import resource
import subprocess
import sys
import time

from absl import app, flags
import jax
import numpy as np

import kda_lm  # noqa: F401  # isort: skip  (first: XLA:CPU flags)
from kda_lm import config as config_lib
from kda_lm import hf
from kda_lm import model as model_lib
from kda_lm.hf import formats, mapping, safetensors_io

_DIR = flags.DEFINE_string("dir", "/tmp/kda_lm_hf_bench",
                           "Where to write the synthetic checkpoint.")
_GIB = flags.DEFINE_float("gib", 3.0, "Approximate checkpoint size (GiB).")
_SHARD_MB = flags.DEFINE_integer("shard_mb", 500, "MB per shard.")
_LOAD = flags.DEFINE_bool("load", False, "Internal: the loading process.")


def bench_config(gib: float) -> config_lib.ModelConfig:
  """A Ling-shaped model of about `gib` GiB in float32."""
  layers = max(4, int(round(gib * 4)))   # ~0.25 GiB per layer.
  return config_lib.ModelConfig.from_config(dict(
      vocab_size=32768, d_model=1024, attention_pattern=model_lib.ling_pattern(
          layers, 4), num_heads=8, head_dim=128, kv_lora_rank=256,
      qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
      mlp_hidden_dim=4096, q_lora_rank=256, mla_output_gate=True,
      num_experts=16, moe_intermediate_size=1024, num_experts_per_tok=2,
      num_shared_experts=1, first_k_dense_replace=1, n_group=4,
      topk_group=2))


def write_checkpoint(path: str, cfg: config_lib.ModelConfig, shard_mb: int):
  """The checkpoint, written tensor by tensor (never all in memory)."""
  os.makedirs(path, exist_ok=True)
  abstract = model_lib.abstract_params(cfg)
  tmap = mapping.tensor_map(cfg, mapping.BAILING)
  rng = np.random.default_rng(0)

  def tensors():
    for name, t in tmap.items():
      shape = mapping.hf_shape(t, tuple(abstract[t.module][t.name].shape),
                               mapping.BAILING)
      yield name, rng.standard_normal(shape, np.float32) * 0.02

  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(formats.to_hf(cfg, mapping.BAILING), f)
  return safetensors_io.write(path, tensors(), shard_mb * 10**6)


def _rss_mib() -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return float("nan")


def load_and_measure(path: str) -> dict:
  """Runs in its own process: baseline RSS, load, peak RSS."""
  jax.numpy.zeros(1).block_until_ready()   # Start the backend.
  base = _rss_mib()
  peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  start = time.time()
  _, params = hf.load_pretrained(path)
  jax.block_until_ready(params)
  seconds = time.time() - start
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  out = sum(x.nbytes for x in jax.tree.leaves(params)) / 2**20
  biggest = max(x.nbytes for x in jax.tree.leaves(params)) / 2**20
  return dict(baseline_mib=base, peak_mib=peak,
              peak_before_load_mib=peak_before, output_mib=out,
              largest_param_mib=biggest, load_s=seconds)


def main(argv):
  del argv
  if _LOAD.value:
    print(json.dumps(load_and_measure(_DIR.value)))
    return
  cfg = bench_config(_GIB.value)
  start = time.time()
  files = write_checkpoint(_DIR.value, cfg, _SHARD_MB.value)
  sizes = [os.path.getsize(os.path.join(_DIR.value, f)) / 2**20
           for f in files if f.endswith(".safetensors")]
  print(f"wrote {len(sizes)} shards, {sum(sizes) / 1024:.2f} GiB, largest "
        f"{max(sizes):.0f} MiB, in {time.time() - start:.0f} s")
  result = subprocess.run(
      [sys.executable, "-m", "experiments.bench_hf_import",
       f"--dir={_DIR.value}", "--load"], check=True, capture_output=True,
      text=True)
  m = json.loads(result.stdout.strip().splitlines()[-1])
  base = max(m["baseline_mib"], m["peak_before_load_mib"])
  rest = m["peak_mib"] - m["output_mib"]
  print(f"load: {m['load_s']:.1f} s; output tree {m['output_mib']:.0f} MiB "
        f"(largest parameter {m['largest_param_mib']:.0f} MiB); peak RSS "
        f"{m['peak_mib']:.0f} MiB (baseline before the load {base:.0f} "
        f"MiB) = the output + {rest:.0f} MiB for everything else, the "
        f"Python/JAX runtime included (one shard: {max(sizes):.0f} MiB)")

if __name__ == "__main__":
  app.run(main)
