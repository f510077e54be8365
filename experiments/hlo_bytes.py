r"""Memory traffic of the KDA op's compiled TPU program, without a TPU.

Compiles `experiments.bench_kda_tpu`'s forward+backward program for a TPU
v5e on a CPU host (a deviceless compile through libtpu, as
`experiments/compile_check.py` does) and lists the operations of the
optimized program's entry computation by the bytes they read and write
(operand and result sizes: an upper bound for fusions, exact for copies and
kernels). It shows what XLA runs around the Pallas kernels: relayouts,
casts and the fusions of anything the kernels leave outside.

  py="$(bash experiments/compile_check_env.sh)"
  "$py" -m experiments.hlo_bytes                    # pallas, 2 x 8192
  "$py" -m experiments.hlo_bytes --impl=xla --top=10
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import re  # noqa: E402

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import bench_kda_tpu, compile_mesh  # noqa: E402
from kda_lm.ops.kda import pallas  # noqa: E402

_IMPL = flags.DEFINE_enum("impl", "pallas", ["pallas", "xla"], "The impl.")
_SHAPE = flags.DEFINE_list("shape", ["2", "8192", "16", "128"], "B,T,H,D.")
_TOPOLOGY = flags.DEFINE_string("topology", "v5e:2x2", "libtpu topology.")
_TOP = flags.DEFINE_integer("top", 12, "Rows to list.")

_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1,
          "s8": 1, "u8": 1}
_SHAPES = re.compile(r"(bf16|f16|f32|s32|u32|pred|s8|u8)\[([0-9,]*)\]")
_OP = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\((.*)")
_FREE = ("parameter", "tuple", "get-tuple-element", "bitcast", "constant")


def nbytes(text):
  """Bytes of every array shape written in `text`."""
  return sum(_BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
             for t, dims in _SHAPES.findall(text))


def entry_traffic(hlo_text):
  """[(bytes read + written, name, opcode, result shape)] of the entry
  computation's operations, largest first."""
  entry = hlo_text[hlo_text.index("ENTRY"):]
  shapes, rows = {}, []
  for line in entry.splitlines()[1:]:
    m = _OP.match(line)
    if not m:
      continue
    name, shape, op, rest = m.groups()
    shapes[name] = shape
    if op in _FREE:
      continue
    operands = re.findall(r"%([\w.\-]+)", rest.split("),")[0])
    total = nbytes(shape) + sum(nbytes(shapes.get(a, "")) for a in operands)
    rows.append((total, name, op, shape))
  return sorted(rows, reverse=True)


def compiled_text(impl, B, T, H, D):
  """The optimized HLO of the benchmark's forward+backward program."""
  devices = compile_mesh.tpu_devices(_TOPOLOGY.value)
  mesh = jax.sharding.Mesh(np.array(devices[:1]), ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
  bf = jnp.bfloat16
  p = {n: s((B, T, H * D), bf) for n in ("q", "k", "v", "g")}
  p.update(beta=s((B, T, H), bf), A_log=s((H,), jnp.float32),
           dt_bias=s((H * D,), jnp.float32))
  options = pallas.for_platform("tpu") if impl == "pallas" else None
  fn = bench_kda_tpu.kda_program(impl, options, backward=True)
  return fn.lower(p, s((B, T), jnp.int32), s((B, T, H * D), bf)).compile(
  ).as_text()


def main(argv):
  del argv
  B, T, H, D = (int(x) for x in _SHAPE.value)
  rows = entry_traffic(compiled_text(_IMPL.value, B, T, H, D))
  total = sum(r[0] for r in rows)
  print(f"impl {_IMPL.value}, B x T = {B} x {T}, H = {H}, K = V = {D}: "
        f"{len(rows)} operations, {total / 1e9:.2f} GB read + written "
        f"({total / 820e9 * 1e3:.2f} ms at a v5e's 820 GB/s)\n")
  print("| MB | op | name | result |\n| --- | --- | --- | --- |")
  for size, name, op, shape in rows[:_TOP.value]:
    print(f"| {size / 1e6:.1f} | {op} | {name} | `{shape[:70]}` |")


if __name__ == "__main__":
  app.run(main)
