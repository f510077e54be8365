r"""Context parallelism: per-device memory, communication and extra FLOPs.

For B=1 row of each length T, the ling3_tiny model's training step
(`jax.value_and_grad` of the next-token cross-entropy over one packed row
with segment ids) is compiled, not run, for 1, 2, 4 and 8 fake CPU devices
on the `context` axis (`kda_lm/parallel/context.py`). From each compiled
step it reports

* temp MiB: XLA's per-device temporaries (`memory_analysis()`), i.e. the
  activations and workspace; ratio against 1 device;
* comm MiB: bytes of the results of every collective in the compiled HLO
  (all-gather, all-reduce, reduce-scatter, collective-permute, all-to-all)
  of one device's program, a count from the HLO text, not a measurement;
* extra FLOPs: (n x per-device FLOPs - single-device FLOPs) / single-device
  FLOPs, matmul FLOPs counted from the compiled HLO with every loop's trip
  count (`testbed/hlo_flops.py`; XLA's `cost_analysis()` counts a
  loop's body once): the work the exchange adds (the widened KDA
  pass, the state combine, MLA's extra diagonal half piece per shard and
  whole-row key expansion, and whatever GSPMD partitions differently).

Usage (each device count compiles in its own subprocess):

  python -m experiments.bench_cp
  python -m experiments.bench_cp --seq_lens=4096 --devices=1,4
"""

import json
import os
import re
import subprocess
import sys

from absl import app, flags

_SEQ_LENS = flags.DEFINE_list("seq_lens", ["4096", "16384"],
                              "Row lengths (tokens).")
_DEVICES = flags.DEFINE_list("devices", ["1", "2", "4", "8"],
                             "Context-parallel device counts.")
_TIMEOUT = flags.DEFINE_integer("timeout", 1800,
                                "Seconds allowed per compile.")

_DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
                "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8, "u64": 8}
_COLLECTIVE = re.compile(
    r"=\s*(.+?)\s+(all-gather|all-reduce|reduce-scatter|collective-permute"
    r"|all-to-all)(?:-start)?\(")
_SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


def collective_bytes(hlo_text: str) -> int:
  """Bytes of the results of the collectives in one device's HLO."""
  total = 0
  for line in hlo_text.splitlines():
    match = _COLLECTIVE.search(line)
    if not match:
      continue
    for dtype, dims in _SHAPE.findall(match.group(1)):
      size = _DTYPE_BYTES.get(dtype, 0)
      for d in filter(None, dims.split(",")):
        size *= int(d)
      total += size
  return total


def _measure(seq_len: int, n: int) -> dict[str, float]:
  """Compiles the step on n devices (this process has exactly n)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from configs import ling3_tiny  # pylint: disable=g-import-not-at-top
  from kda_lm import config as config_lib  # pylint: disable=g-import-not-at-top
  from kda_lm import model  # pylint: disable=g-import-not-at-top
  from kda_lm.parallel import sharding
  from testbed import hlo_flops  # pylint: disable=g-import-not-at-top

  m = ling3_tiny.get_config().model
  m.vocab_size = 256
  net = model.build(config_lib.ModelConfig.from_config(m))
  ids = np.ones((1, seq_len), np.int32)
  ids[0, seq_len // 3:] = 2          # two documents, one boundary
  tokens = jnp.zeros((1, seq_len), jnp.int32)
  params = jax.eval_shape(net.init, jax.random.PRNGKey(0), tokens, ids)

  def loss(p, tokens, ids):
    logits = net.apply(p, tokens, ids)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[..., None], -1))

  mesh = sharding.make_mesh(
      ml_collections.ConfigDict(dict(data=1, fsdp=1, context=n)))
  rows = sharding.batch_sharding(mesh)
  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.value_and_grad(loss),
                       in_shardings=(sharding.replicated(mesh), rows, rows)
                       ).lower(params, jax.ShapeDtypeStruct(
                           tokens.shape, tokens.dtype),
                               jax.ShapeDtypeStruct(ids.shape, jnp.int32)
                               ).compile()
  return {"temp": compiled.memory_analysis().temp_size_in_bytes,
          "flops": float(hlo_flops.count(compiled.as_text()).total),
          "comm": collective_bytes(compiled.as_text())}


def _run(seq_len: int, n: int) -> dict[str, float] | str:
  """`_measure` in a subprocess with n fake CPU devices."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      f" --xla_force_host_platform_device_count={n}")
  code = ("import json, sys; from experiments import bench_cp; "
          f"print(json.dumps(bench_cp._measure({seq_len}, {n})))")
  try:
    result = subprocess.run([sys.executable, "-c", code], env=env,
                            capture_output=True, text=True,
                            timeout=_TIMEOUT.value, check=False)
  except subprocess.TimeoutExpired:
    return f"compile > {_TIMEOUT.value} s"
  if result.returncode:
    return "failed: " + result.stderr.strip().splitlines()[-1][:80]
  return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv):
  del argv
  mib = 2.0 ** 20
  print("| T | CP | temp MiB/device | vs CP=1 | comm MiB/device | "
        "extra FLOPs vs CP=1 |")
  print("| --- | --- | --- | --- | --- | --- |")
  for seq_len in map(int, _SEQ_LENS.value):
    base = None
    for n in map(int, _DEVICES.value):
      got = _run(seq_len, n)
      if isinstance(got, str):
        print(f"| {seq_len} | {n} | {got} | | | |", flush=True)
        continue
      if n == 1:
        base = got
      ratio = f"{got['temp'] / base['temp']:.2f}x" if base else "-"
      extra = (f"{(n * got['flops'] - base['flops']) / base['flops']:+.1%}"
               if base else "-")
      print(f"| {seq_len} | {n} | {got['temp'] / mib:.1f} | {ratio} | "
            f"{got['comm'] / mib:.2f} | {extra} |", flush=True)


if __name__ == "__main__":
  app.run(main)
