r"""Deviceless compile of a full training step on multi-chip meshes.

Compiles, on a CPU-only host, one training step (forward, gradient, AdamW
update, the MoE selection-bias update) of Ling-3.0-tiny's widths
(`configs/ling3.py:tiny`, cut to `--layers` layers of its pattern) with
`kda_impl="auto"` and `moe_impl="auto"`, as a run on the target takes it,
for each row: a target (TPU v5p `2x2x1`, 4 chips; a host of n H100s), a
mesh and a batch. Each row prints per-device memory (arguments,
temporaries), the compiled matmul FLOPs per device (`hlo_flops.count` on
the optimized HLO, TPU and GPU alike), and the analytic FLOPs per device:

  6 x activated parameters x tokens / devices          (matmuls)
  + 3 x causal MLA attention (2 H (K + V) per query-key pair)
  + 3 x the KDA chunk core (intra-chunk pairs and state products)

The check fails (exit 1) when a compile fails or compiled / analytic
exceeds `--max_ratio` (1.3). Run in the compile
check's environment (libtpu, the CUDA plugin):

  py="$(bash experiments/compile_check_env.sh)"
  "$py" -m experiments.compile_mesh                       # the docs table
  "$py" -m experiments.compile_mesh --seq_len=512 --layers=4   # CI's size

A row is `target:mesh:B[:model]`, e.g. `v5p:data=2+fsdp=2:4`,
`h100x1:data=1:1:dense` or `v5p32:fsdp=4+expert=4:16:flash`. Targets:
`v5p` (a `2x2x1` slice, 4 chips), `v5p32` (`2x2x4`, 16 chips), `h100x<n>`.
Mesh axes: `data`, `fsdp`, `expert`, `context`. Models: Ling-3.0-tiny's
widths (default), `dense` (those with `num_experts=0`, dense SwiGLU layers
of the same active width, the reference for the MoE's memory), `flash`
(Ling-3.0-flash's widths), `kimi` (Kimi-Linear-48B's widths, written
here from its published config), each cut to `--layers` layers; `@c`
after the model sets `moe_capacity_factor` (e.g. `flash@1.25`).

Each row also reports the collectives of the compiled step per device
(`compile_report.collective_bytes` on the HLO text): all-gathers, the
all-gathers of routed expert weights alone (arrays `[e, D, F]` or
`[e, F, D]`), all-reduces (with reduce-scatters) and all-to-alls. A
collective inside a loop counts once.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from configs import kimi_linear, ling3  # noqa: E402
import kda_lm  # noqa: E402,F401  (XLA:CPU flags)
from kda_lm import config as config_lib  # noqa: E402
from kda_lm import flops, optimizer  # noqa: E402
from kda_lm import model as model_lib  # noqa: E402
from kda_lm.parallel import sharding
from kda_lm.train import state as state_lib
from kda_lm.train import step as step_lib
from testbed import compile_report, hlo_flops

DEFAULT_ROWS = ["v5p:fsdp=4:4", "v5p:data=4:4", "v5p:data=2+fsdp=2:4",
                "v5p:context=2+fsdp=2:4", "h100x4:fsdp=4:4",
                "h100x4:data=2+fsdp=2:4", "h100x1:data=1:1",
                "h100x1:data=1:1:dense"]

HERE = os.path.dirname(os.path.abspath(__file__))
H100_SPEC = os.path.join(HERE, "targets", "h100_sxm.txtpb")
TPU_TOPOLOGIES = {"v5p": "v5p:2x2x1", "v5p32": "v5p:2x2x4"}
GIB = 2.0 ** 30


@dataclasses.dataclass
class Row:
  """One compiled training step."""
  spec: str
  args_gib: float = 0.0
  temp_gib: float = 0.0
  compiled_tflop: float = 0.0     # Matmul FLOPs read from the HLO.
  analytic_tflop: float = 0.0
  # Collectives per device (GiB): all-gathers, those of routed expert
  # weights, all-reduces and reduce-scatters, all-to-alls.
  gather_gib: float = 0.0
  expert_gather_gib: float = 0.0
  reduce_gib: float = 0.0
  a2a_gib: float = 0.0
  seconds: float = 0.0
  problems: list = dataclasses.field(default_factory=list)


def tpu_devices(topology: str) -> list:
  """Compile-only devices of a TPU topology ("v5p:2x2x1"), the one place
  that asks libtpu for them.

  Several such compiles may run on one host at once: libtpu's lock file
  keeps a second process off a real chip, and there is no chip here
  (without `ALLOW_MULTIPLE_LIBTPU_LOAD` the second process stops, and its
  message advises deleting the first one's lock).
  """
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  return topologies.get_topology_desc(topology_name=topology,
                                      platform="tpu").devices


def devices(target):
  """Compile-only devices of `target` ("v5p", "h100x<n>")."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  if target in TPU_TOPOLOGIES:
    return tpu_devices(TPU_TOPOLOGIES[target])
  if target.startswith("h100x"):
    with open(H100_SPEC) as f:
      return topologies.get_topology_desc(
          platform="cuda", target_config=f.read(),
          topology=f"1x1x{int(target[5:])}").devices
  raise ValueError(f"Unknown target {target!r}: v5p or h100x<n>.")


def parse_mesh(text):
  """"data=2+fsdp=2" -> a `config.mesh` ConfigDict (missing axes 1)."""
  sizes = dict(data=1, fsdp=1, expert=1, context=1)
  for item in text.split("+"):
    name, value = item.split("=")
    if name not in sizes:
      raise ValueError(f"Unknown mesh axis {name!r} in {text!r}.")
    sizes[name] = int(value)
  return ml_collections.ConfigDict(sizes)


def model_config(layers, model="tiny"):
  """`model`'s widths ("tiny", "dense", "flash", "kimi"; `name@c` sets
  `moe_capacity_factor` c) with `layers` layers of its pattern: a `model`
  ConfigDict (`typed_model_config` reads it)."""
  model, _, capacity = model.partition("@")
  if model == "kimi":
    m = kimi_linear.model_config()
  elif model in ("tiny", "dense", "flash"):
    m = ling3.model_config("flash" if model == "flash" else "tiny")
  else:
    raise ValueError(f"Unknown model {model!r}: tiny, dense, flash, kimi.")
  if layers is not None:    # None: the model's full depth.
    m.attention_pattern = m.attention_pattern[:layers - 1] + "M"
  if capacity:
    m.moe_capacity_factor = float(capacity)
  if model == "dense":
    m.num_experts = 0
    m.mlp_hidden_dim = (m.num_experts_per_tok + m.num_shared_experts) * (
        m.moe_intermediate_size)
  return m


def typed_model_config(layers, model="tiny") -> config_lib.ModelConfig:
  """`model_config(layers, model)`, read into its `ModelConfig`."""
  return config_lib.ModelConfig.from_config(model_config(layers, model))


def analytic_flops(m, B, T):
  """Training FLOPs of one step (all devices): `kda_lm.flops.step_flops`."""
  return flops.step_flops(m, B, T)


@contextlib.contextmanager
def backend(platform):
  """JAX's default backend read as `platform` while tracing (impl "auto"
  and the kernel options pick the target's paths)."""
  real = jax.default_backend
  jax.default_backend = lambda: platform
  try:
    yield
  finally:
    jax.default_backend = real


def compile_step(m, mesh_config, devs, B, T, platform, remat="none",
                 accum=1, loss_chunks=1):
  """The compiled training step (`remat` policy, `accum` micro-batches,
  the loss in `loss_chunks` pieces): (compiled, seconds)."""
  mesh = sharding.make_mesh(mesh_config, list(devs))
  sharding.check_expert_axis(mesh_config.expert, m.num_experts)
  sharding.check_batch_shape(mesh, B, T, accum, loss_chunks)
  model = model_lib.build(m, remat=remat)
  opt = ling3.get_config().opt
  tx, schedule = optimizer.make_optimizer(opt, 100)
  with backend(platform):
    layout = state_lib.state_layout(model, tx, T, mesh)
  state, shardings = layout.abstract, layout.shardings
  rows = sharding.batch_sharding(mesh)
  tok = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=rows)
  batch = dict(inputs=tok, targets=tok, segment_ids=tok, positions=tok,
               loss_mask=jax.ShapeDtypeStruct((B, T), jnp.float32,
                                              sharding=rows))
  update = jax.jit(step_lib.make_update_fn(model, tx, schedule, m, accum,
                                           loss_chunks),
                   out_shardings=(shardings, sharding.replicated(mesh)),
                   donate_argnums=0)
  start = time.time()
  with backend(platform), jax.set_mesh(mesh):
    lowered = update.trace(state, batch).lower(
        lowering_platforms=("cuda" if platform == "gpu" else "tpu",))
  compiled = lowered.compile()
  return compiled, time.time() - start


def state_and_grads_gib(m, mesh_config, devs):
  """GiB per device of the train state (parameters, AdamW moments) of the
  model `m` as `sharding.state_shardings` lays it out on the mesh, and of
  one gradient per parameter laid out as the parameters."""
  mesh = sharding.make_mesh(mesh_config, list(devs))
  model = model_lib.build(m)
  tx, _ = optimizer.make_optimizer(ling3.get_config().opt, 100)
  layout = state_lib.state_layout(model, tx, 1, mesh)
  abstract, shardings = layout.abstract, layout.shardings

  def gib(tree, tree_shardings):
    return sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
               for a, s in zip(jax.tree.leaves(tree),
                               jax.tree.leaves(tree_shardings), strict=True)
               ) / GIB

  return gib(abstract, shardings), gib(abstract.params, shardings.params)


def state_gib(m, mesh_config, devs):
  """GiB per device of the train state (`state_and_grads_gib`'s first)."""
  return state_and_grads_gib(m, mesh_config, devs)[0]


def state_table(specs):
  """`--state_only`: the full-depth state per device of each row."""
  print("| target:mesh:B:model | full-depth state GiB/dev |")
  print("|---|---|")
  for spec in specs:
    target, mesh_text, _, *rest = spec.split(":")
    m = typed_model_config(None, rest[0] if rest else "tiny")
    mesh_config = parse_mesh(mesh_text)
    count = (mesh_config.data * mesh_config.fsdp * mesh_config.expert
             * mesh_config.context)
    gib = state_gib(m, mesh_config, devices(target)[:count])
    print(f"| {spec} | {gib:.2f} |", flush=True)


def expert_weight(m, expert):
  """`select` for `collective_bytes`: all-gathered routed expert weights
  (`[E/expert, D, F]` or `[E/expert, F, D]`)."""
  if not m.num_experts:
    return lambda *_: False
  D, F = m.d_model, m.moe_intermediate_size
  e = m.num_experts // expert
  shapes = {(e, D, F), (e, F, D)}
  return lambda kind, dt, dims: kind == "all-gather" and dims in shapes


def run_row(spec, layers, T):
  target, mesh_text, b, *rest = spec.split(":")
  row = Row(spec)
  m = typed_model_config(layers, rest[0] if rest else "tiny")
  mesh_config = parse_mesh(mesh_text)
  devs = devices(target)
  count = (mesh_config.data * mesh_config.fsdp * mesh_config.expert
           * mesh_config.context)
  platform = "tpu" if target in TPU_TOPOLOGIES else "gpu"
  row.analytic_tflop = analytic_flops(m, int(b), T) / count / 1e12
  try:
    compiled, row.seconds = compile_step(m, mesh_config, devs[:count],
                                         int(b), T, platform)
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    row.problems.append(f"{type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200]}")
    return row
  memory = compiled.memory_analysis()
  row.args_gib = memory.argument_size_in_bytes / GIB
  row.temp_gib = memory.temp_size_in_bytes / GIB
  hlo = compiled.as_text()
  row.compiled_tflop = hlo_flops.count(hlo).total / 1e12
  if flags.FLAGS.hlo_dir:
    os.makedirs(flags.FLAGS.hlo_dir, exist_ok=True)
    with open(os.path.join(flags.FLAGS.hlo_dir, spec.replace(":", "_")
                           + ".hlo.txt"), "w") as f:
      f.write(hlo)
  moved = compile_report.collective_bytes(hlo)
  row.gather_gib = moved.get("all-gather", 0) / GIB
  row.reduce_gib = (moved.get("all-reduce", 0)
                    + moved.get("reduce-scatter", 0)) / GIB
  row.a2a_gib = (moved.get("all-to-all", 0)
                 + moved.get("ragged-all-to-all", 0)) / GIB
  row.expert_gather_gib = compile_report.collective_bytes(
      hlo, expert_weight(m, mesh_config.expert)).get("all-gather", 0) / GIB
  return row


def check(row, max_ratio):
  if row.compiled_tflop and row.analytic_tflop:
    ratio = row.compiled_tflop / row.analytic_tflop
    if ratio > max_ratio:
      row.problems.append(f"compiled/analytic FLOPs {ratio:.2f} > "
                          f"{max_ratio}")
  return row


HEADER = ("| target:mesh:B | args GiB/dev | temp GiB/dev | compiled "
          "TFLOP/dev | analytic TFLOP/dev | ratio | all-gather GiB/dev | "
          "expert all-gather GiB/dev | all-reduce GiB/dev | all-to-all "
          "GiB/dev | compile s | status |")


def fmt(row):
  ratio = (f"{row.compiled_tflop / row.analytic_tflop:.2f}"
           if row.compiled_tflop else "-")
  compiled = f"{row.compiled_tflop:.3f}" if row.compiled_tflop else "-"
  status = "ok" if not row.problems else "FAIL: " + "; ".join(row.problems)
  return (f"| {row.spec} | {row.args_gib:.2f} | {row.temp_gib:.2f} | "
          f"{compiled} | {row.analytic_tflop:.3f} | {ratio} | "
          f"{row.gather_gib:.3f} | {row.expert_gather_gib:.3f} | "
          f"{row.reduce_gib:.3f} | {row.a2a_gib:.3f} | {row.seconds:.0f} | "
          f"{status} |")


def main(argv):
  del argv
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  if FLAGS.state_only:
    state_table(FLAGS.rows)
    return 0
  m = typed_model_config(FLAGS.layers)
  print(f"jax {jax.__version__}; Ling-3.0-tiny widths, pattern "
        f"{m.attention_pattern}, T={FLAGS.seq_len}, kda_impl and "
        f"moe_impl auto, {m.compute_dtype} activations", flush=True)
  print(HEADER)
  print("|" + "---|" * 12, flush=True)
  rows = []
  for spec in FLAGS.rows:
    row = check(run_row(spec, FLAGS.layers, FLAGS.seq_len),
                FLAGS.max_ratio)
    print(fmt(row), flush=True)
    rows.append(row)
  bad = [r for r in rows if r.problems]
  print(f"{len(rows)} compiled, {len(bad)} failed")
  return 1 if bad or not rows else 0


def define_flags():
  """The command's flags (defined only when run: `experiments.fit`
  imports this module's functions)."""
  flags.DEFINE_list("rows", DEFAULT_ROWS, "target:mesh:B[:model].")
  flags.DEFINE_integer("layers", 4, "Decoder layers (KKKM...).")
  flags.DEFINE_integer("seq_len", 4096, "T, tokens per row.")
  flags.DEFINE_float("max_ratio", 1.3, "Largest compiled / analytic FLOPs.")
  flags.DEFINE_string("hlo_dir", None,
                      "Write each row's compiled HLO text here.")
  flags.DEFINE_bool("state_only", False, "Compile nothing: print each row's "
                    "full-depth train state (parameters and AdamW moments) "
                    "per device.")


if __name__ == "__main__":
  define_flags()
  app.run(lambda argv: sys.exit(main(argv)))
