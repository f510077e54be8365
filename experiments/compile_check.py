r"""Deviceless ahead-of-time compile check of the Pallas KDA kernels.

Compiles, on a CPU-only host, every kernel that `chunk_kda(impl="pallas")`
runs (forward and gradient at B=1, T=8192, H=16, K=V=128, bfloat16) for an
H100/H200 (CUDA sm_90a: XLA's real Triton -> PTX -> ptxas pipeline, with its
shared-memory check) and for TPU v5e and v6e (Mosaic, through libtpu), at
the default `KernelOptions` of each platform. It prints one row per kernel
(target, grid, warps/stages, shared memory or VMEM, registers, spill bytes,
compile seconds), then compiles the whole forward and gradient with and
without `segment_ids` and one `ling3_tiny` training step with
`kda_impl="auto"` for the GPU target. Exits 1 when anything fails to
compile or a kernel exceeds a limit:

  GPU: shared memory <= the target's opt-in limit per block, and at most
       `--max_spill_bytes` (1024) of register spill stores or loads per
       thread (ptxas -v);
  TPU: the kernel's scoped-VMEM request <= the chip's VMEM (Mosaic itself
       fails the compile when a kernel needs more than it requested).

It needs the CUDA plugin, ptxas and libtpu on its path, beside the
repository's environment and never in it (with the CUDA plugin importable
jax probes for a GPU on import):

  py="$(bash experiments/compile_check_env.sh)"
  "$py" -m experiments.compile_check
  "$py" -m experiments.compile_check --targets=h100 --kernels=intra_kernel \
      --override=num_warps=4,precision=highest

How it works: `jax.experimental.topologies.get_topology_desc` builds compile-
only devices from a target description (experiments/targets/h100_sxm.txtpb
for the GPU, libtpu's "v5e:2x2" / "v6e:2x2" topologies for TPU; a 1x1 TPU
layout is refused), a one-device mesh on them shards the abstract inputs,
and `jax.jit(f).trace(...).lower(...).compile()` runs XLA's compiler for
that target ("Performing a deviceless compilation"). Each kernel is
compiled on its own (its pallas_call equation cut out of the traced
gradient), so every row has its own compile time and one failure does not
hide the others. Registers and spills come from ptxas's `-v` lines (XLA logs
them with TF_CPP_VMODULE=subprocess_compilation=2), shared memory from the
thunk sequence XLA dumps (`xla_dump_to`).
"""

import os

# Before JAX starts: there is no GPU, so skip the CUDA plugin's runtime
# version check (its compiler still loads); let XLA log ptxas's -v lines.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
os.environ["TF_CPP_VMODULE"] = "subprocess_compilation=2"

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import glob  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.extend  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import compile_mesh  # noqa: E402
import kda_lm  # noqa: E402,F401  (XLA:CPU flags)
from kda_lm.ops import chunk_kda  # noqa: E402
from kda_lm.ops.kda import pallas  # noqa: E402
from testbed import compile_report  # noqa: E402

_TARGETS = flags.DEFINE_list("targets", ["h100", "v5e", "v6e"],
                             "Targets: h100 (sm_90a), v5e, v6e.")
_KERNELS = flags.DEFINE_list("kernels", [],
                             "Only these kernels (default: all).")
_OVERRIDE = flags.DEFINE_list(
    "override", [], "KernelOptions fields replacing the platform defaults, "
    "e.g. num_warps=4,precision=highest.")
_FULL = flags.DEFINE_bool("full", True, "Also compile the whole forward and "
                          "gradient and the ling3_tiny training step.")
_PROGRAMS = flags.DEFINE_list(
    "programs", ["forward:segments", "gradient:segments", "forward:none",
                 "gradient:none", "forward:segments:bounded",
                 "gradient:segments:bounded"],
    "Whole programs compiled with --full (what:segments|none, and "
    "':bounded' for the bounded gate).")
_TRAIN_STEP = flags.DEFINE_bool(
    "train_step", True, "With --full, also compile one ling3_tiny training "
    "step for each GPU target (the slowest program: minutes).")
_MAX_SPILL = flags.DEFINE_integer("max_spill_bytes", 1024,
                                  "Spill stores or loads allowed per thread.")
_SHAPE = flags.DEFINE_list("shape", ["1", "8192", "16", "128"], "B,T,H,D.")

HERE = os.path.dirname(os.path.abspath(__file__))
H100_SPEC = os.path.join(HERE, "targets", "h100_sxm.txtpb")
TPU_VMEM_BYTES = {"v5e": 128 << 20, "v6e": 128 << 20}
GPU = {"h100": H100_SPEC}
TPU = {"v5e": "v5e:2x2", "v6e": "v6e:2x2"}


@dataclasses.dataclass
class Row:
  """One compiled kernel (or whole program) on one target."""
  target: str
  kernel: str
  grid: str = ""
  config: str = ""          # warps/stages (GPU) or dimension semantics (TPU)
  memory: str = ""          # shared memory (GPU) or VMEM request (TPU)
  registers: str = ""
  spill: str = ""           # "stores/loads" bytes per thread
  seconds: float = 0.0
  problems: list = dataclasses.field(default_factory=list)

  @property
  def ok(self):
    return not self.problems


# ----------------------------------------------------------------------------
# Targets, inputs, kernels.


def _devices(target):
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  if target in GPU:
    with open(GPU[target]) as f:
      spec = f.read()
    return topologies.get_topology_desc(
        platform="cuda", target_config=spec, topology="1x1x1").devices
  return compile_mesh.tpu_devices(TPU[target])


def _mesh(target):
  return jax.sharding.Mesh(np.array(_devices(target)[:1]), ("x",))


def _options(platform):
  opts = pallas.for_platform(platform)
  changes = {}
  for item in _OVERRIDE.value:
    name, value = item.split("=", 1)
    field = type(getattr(opts, name))
    changes[name] = (value in ("1", "true", "True")) if field is bool \
        else field(value)
  return dataclasses.replace(opts, **changes)


def _abstract(mesh, segments=True):
  b, t, h, d = (int(x) for x in _SHAPE.value)
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  S = functools.partial(jax.ShapeDtypeStruct, sharding=rep)
  bf = jnp.bfloat16
  params = dict(q=S((b, t, h, d), bf), k=S((b, t, h, d), bf),
                v=S((b, t, h, d), bf), g=S((b, t, h, d), bf),
                beta=S((b, t, h), bf),
                initial_state=S((b, h, d, d), jnp.float32),
                A_log=S((h,), jnp.float32), dt_bias=S((h * d,), jnp.float32))
  return params, (S((b, t), jnp.int32) if segments else None)


def _kda(params, seg, opts, bounded=False):
  """The op with the in-kernel gate: unbounded (softplus: the generic
  kernels) or `bounded` (lower_bound -5: on TPU the "tpu" family)."""
  bound = dict(lower_bound=-5.0, safe_gate=True) if bounded else {}
  return chunk_kda(**params, segment_ids=seg, output_final_state=True,
                   use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                   impl="pallas", pallas_options=opts, **bound)


def _loss(params, seg, opts, bounded=False):
  o, state = _kda(params, seg, opts, bounded)
  return jnp.sum(o.astype(jnp.float32)) + jnp.sum(state)


def _pallas_eqns(jaxpr, out):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      out.append(eqn)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          _pallas_eqns(sub.jaxpr, out)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          _pallas_eqns(sub, out)
  return out


def kernel_calls(platform, opts, mesh):
  """{name: (fn, abstract args, eqn)}: each pallas_call of the forward and
  the gradient lowered for `platform` ("gpu" or "tpu"), alone."""
  params, seg = _abstract(mesh)
  eqns = []
  for bounded in (False, True):
    jaxpr = jax.make_jaxpr(jax.grad(_loss), static_argnums=(2, 3))(
        params, seg, opts, bounded)
    fwd = jax.make_jaxpr(_kda, static_argnums=(2, 3))(params, seg, opts,
                                                      bounded)
    eqns += _pallas_eqns(jaxpr.jaxpr, []) + _pallas_eqns(fwd.jaxpr, [])
  module = "triton" if platform == "gpu" else "mosaic"
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  calls = {}
  for eqn in eqns:
    if module not in type(eqn.params["compiler_params"]).__module__:
      continue
    name = eqn.params["name"] or "kernel"
    if name in calls:
      continue
    one = jax.extend.core.Jaxpr([], eqn.invars, eqn.outvars, [eqn])

    def fn(*args, _j=one):
      return jax.core.eval_jaxpr(_j, [], *args)
    args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=rep)
            for v in eqn.invars]
    calls[name] = (fn, args, eqn)
  return calls


# ----------------------------------------------------------------------------
# Compiling with XLA's reports captured.


@contextlib.contextmanager
def _captured_stderr():
  """Redirects file descriptor 2 (XLA's C++ logs) into a string list."""
  sys.stderr.flush()
  saved = os.dup(2)
  log = []
  with tempfile.TemporaryFile(mode="w+b") as tmp:
    os.dup2(tmp.fileno(), 2)
    try:
      yield log
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      tmp.seek(0)
      log.append(tmp.read().decode("utf-8", "replace"))


def compile_once(fn, args, platform):
  """Compiles jit(fn)(*args) for `platform`; returns (seconds, ptxas log,
  thunk text, error or None)."""
  lowering = "cuda" if platform == "gpu" else "tpu"
  with tempfile.TemporaryDirectory() as dump, _captured_stderr() as log:
    start = time.time()
    error = None
    try:
      lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(lowering,))
      opts = {"xla_dump_to": dump} if platform == "gpu" else {}
      lowered.compile(compiler_options=opts)
    except Exception as e:  # pylint: disable=broad-except
      error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    seconds = time.time() - start
    thunks = "".join(open(p).read() for p in glob.glob(
        os.path.join(dump, "*thunk_sequence.txt")))
  return seconds, log[0], thunks, error


def _gpu_row(target, name, eqn, opts, seconds, log, thunks, error,
             shared_limit):
  grid = "x".join(str(g) for g in eqn.params["grid_mapping"].grid)
  row = Row(target, name, grid=grid,
            config=f"{opts.num_warps}w/{opts.num_stages}s "
                   f"{opts.precision}", seconds=seconds)
  if error:
    row.problems.append(error)
  ptx = compile_report.parse_ptxas(log)
  regs = [v for k, v in ptx.items() if k.startswith(name)]
  shared = [t[3] for t in compile_report.parse_thunks(thunks)
            if t[0].startswith(name)]
  if regs:
    r, stores, loads = regs[0]
    row.registers = str(r)
    row.spill = f"{stores}/{loads}"
    shared_used = shared[0] if shared else 0
    row.memory = f"{shared_used:,}" if shared else "?"
    row.problems += compile_report.gpu_problems(
        shared_used, shared_limit, (stores, loads), _MAX_SPILL.value)
  else:
    m = re.search(r"Shared memory size limit exceeded: requested (\d+)",
                  log + (error or ""))
    if m:
      row.memory = f"{int(m.group(1)):,} (over)"
    if not error:
      row.problems.append("no ptxas report")
  return row


def _tpu_row(target, name, eqn, seconds, error):
  params = eqn.params["compiler_params"]
  grid = "x".join(str(g) for g in eqn.params["grid_mapping"].grid)
  limit = getattr(params, "vmem_limit_bytes", None) or 0
  sem = getattr(params, "dimension_semantics", None) or ()
  row = Row(target, name, grid=grid,
            config="/".join(str(s)[:3] for s in sem), seconds=seconds,
            memory=f"{limit / 2**20:.0f} MiB" if limit else "default")
  if error:
    row.problems.append(error)
  if limit > TPU_VMEM_BYTES[target]:
    row.problems.append(f"VMEM request {limit} > {TPU_VMEM_BYTES[target]}")
  return row


def check_kernels(target):
  platform = "gpu" if target in GPU else "tpu"
  mesh = _mesh(target)
  opts = _options(platform)
  print(f"# {target}: {opts}", flush=True)
  shared_limit = 0
  if platform == "gpu":
    with open(GPU[target]) as f:
      shared_limit = int(re.search(r"shared_memory_per_block_optin: (\d+)",
                                   f.read()).group(1))
  rows = []
  for name, (fn, args, eqn) in kernel_calls(platform, opts, mesh).items():
    if _KERNELS.value and name not in _KERNELS.value:
      continue
    seconds, log, thunks, error = compile_once(fn, args, platform)
    if platform == "gpu":
      row = _gpu_row(target, name, eqn, opts, seconds, log, thunks, error,
                     shared_limit)
    else:
      row = _tpu_row(target, name, eqn, seconds, error)
    print(_format(row), flush=True)
    rows.append(row)
  return rows


def check_programs(target):
  """The whole forward and gradient, with and without segment_ids."""
  platform = "gpu" if target in GPU else "tpu"
  mesh = _mesh(target)
  opts = _options(platform)
  rows = []
  fns = {"forward": _kda, "gradient": jax.grad(_loss)}
  for program in _PROGRAMS.value:
    what, segs, *bound = program.split(":")
    segments = segs == "segments"
    bounded = bound == ["bounded"]
    params, seg = _abstract(mesh, segments)
    seconds, _, _, error = compile_once(
        functools.partial(fns[what], opts=opts, bounded=bounded),
        (params, seg), platform)
    gate = ", bounded gate" if bounded else ""
    row = Row(target, f"{what} ({'segments' if segments else 'no segs'}"
              f"{gate})", seconds=seconds,
              problems=[error] if error else [])
    print(_format(row), flush=True)
    rows.append(row)
  return rows


def check_train_step(target):
  """One ling3_tiny training step (forward, gradient, optimizer update)
  with kda_impl "auto" compiled for the GPU target, as a GPU run takes it:
  JAX's default backend reads "gpu" while tracing."""
  from configs import ling3_tiny  # pylint: disable=g-import-not-at-top

  # pylint: disable=g-import-not-at-top
  from kda_lm import config as config_lib
  from kda_lm import model as model_lib
  from kda_lm import optimizer
  from kda_lm.train import state as state_lib
  from kda_lm.train import step as step_lib
  config = ling3_tiny.get_config()
  mesh = _mesh(target)
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  model_config = config_lib.ModelConfig.from_config(config.model)
  model = model_lib.build(model_config)
  tx, schedule = optimizer.make_optimizer(config.opt, 10)
  update = step_lib.make_update_fn(model, tx, schedule, model_config)
  b, t = int(config.data.batch_size), int(config.data.seq_len)
  init = state_lib.make_init_fn(model, tx, t)
  abstract = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep),
      jax.eval_shape(init, jax.random.PRNGKey(0)))
  tok = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rep)
  batch = dict(inputs=tok, targets=tok, segment_ids=tok, positions=tok,
               loss_mask=jax.ShapeDtypeStruct((b, t), jnp.float32,
                                              sharding=rep))
  real_backend = jax.default_backend
  jax.default_backend = lambda: "gpu"
  try:
    seconds, log, _, error = compile_once(update, (abstract, batch), "gpu")
  finally:
    jax.default_backend = real_backend
  kernels = len(compile_report.parse_ptxas(log))
  row = Row(target, f"ling3_tiny train step ({kernels} Triton kernels)",
            seconds=seconds, problems=[error] if error else [])
  if not error and not kernels:
    row.problems.append("no Pallas kernel in the step (impl auto != pallas)")
  print(_format(row), flush=True)
  return [row]


HEADER = ("| target | kernel | grid | warps/stages, dots | smem B / VMEM "
          "| regs | spill st/ld B | compile s | status |")


def _format(row):
  status = "ok" if row.ok else "FAIL: " + "; ".join(row.problems)
  return (f"| {row.target} | {row.kernel} | {row.grid} | {row.config} | "
          f"{row.memory} | {row.registers} | {row.spill} | "
          f"{row.seconds:.1f} | {status} |")


def main(argv):
  del argv
  print(f"jax {jax.__version__}, shape B,T,H,D = {','.join(_SHAPE.value)}, "
        "bfloat16 inputs", flush=True)
  print(HEADER)
  print("|" + "---|" * 9, flush=True)
  rows = []
  start = time.time()
  for target in _TARGETS.value:
    try:
      rows += check_kernels(target)
      if _FULL.value:
        rows += check_programs(target)
        if target in GPU and _TRAIN_STEP.value:
          rows += check_train_step(target)
    except Exception:  # pylint: disable=broad-except
      traceback.print_exc()
      rows.append(Row(target, "setup", problems=["exception (see above)"]))
  bad = [r for r in rows if not r.ok]
  print(f"{len(rows)} compiled, {len(bad)} failed "
        f"({time.time() - start:.0f} s)")
  return 1 if bad or not rows else 0


if __name__ == "__main__":
  app.run(lambda argv: sys.exit(main(argv)))
