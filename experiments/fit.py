r"""Fit report: does one training step of a named model fit a named slice?

Compiles, deviceless on a CPU host, one full training step (forward,
gradient, AdamW, the MoE selection-bias update) of a published model for a
target slice, mesh, sequence length, batch, rematerialisation policy and
gradient accumulation, and prints per device: arguments (parameters,
optimizer state, batch), temporaries and their total against the chip's
HBM; the compiled matmul FLOPs (`testbed/hlo_flops.py`: read from the
optimized program, every loop times its trip count, so scanned layers and
the loss's pieces count in full on TPU and GPU alike), the share of them
that recomputes a forward pass (rematerialisation, the loss's pieces), the
analytic FLOPs and the ratio of compiled less recompute to analytic; the
roofline step time (compiled FLOPs / chip peak) and the tokens/s per chip
it implies; and the compile seconds on this host. Run in the compile
check's environment (libtpu, the CUDA plugin):

  py="$(bash experiments/compile_check_env.sh)"
  "$py" -m experiments.fit --model=ling3:tiny --target=v5p-8 \
      --mesh=fsdp=4 --seq_len=4096 --batch=4 --remat=save_dots
  "$py" -m experiments.fit --model=ling3:tiny --target=v5p-8 \
      --mesh=fsdp=4 --seq_len=4096 --batch=4 --search   # smallest remat
                                                        # that fits
`--batch` is the global batch of one optimizer step; `--grad_accum` splits
it into micro-batches. `--search` tries the remat policies from `none` to
`full` and reports the first that fits (total <= HBM). `--grow` then
doubles the batch while the step still fits, and reports the largest
micro-batch that fits with that policy (one compile per try).
`--layers` cuts the stack to its first n layers (the pattern's last layer
made MLA), for the compile-time-in-depth comparison; `--noscan` compiles
every layer.

Before compiling, the report lays the float32 parameters, their gradients
and the AdamW moments out on the mesh as training does (no compile,
seconds). All of them exist at once when the global gradient norm is
taken (the optimizer clips by it), so when they alone exceed the chip's
HBM, the row says so and nothing is compiled: no remat policy or batch
size can make that step fit.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import functools  # noqa: E402
import gzip  # noqa: E402
import importlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

from absl import app, flags, logging  # noqa: E402
import jax  # noqa: E402

from experiments import compile_mesh  # noqa: E402
import kda_lm  # noqa: E402,F401  (XLA:CPU flags)
from kda_lm import config as config_lib  # noqa: E402
from testbed import hlo_flops  # noqa: E402

GIB = 2.0 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
  """A chip's HBM (GiB) and dense bf16 peak (TFLOP/s), from the vendors'
  data sheets, and the compile target of a slice of them."""
  name: str
  hbm_gib: float
  peak_tflops: float
  platform: str          # "tpu" or "gpu"
  topology: str          # libtpu topology, or "1x1x<n>" GPUs on one host


# Slices: TPU names count TensorCores (v5p-8 = 4 chips); GPU hosts chips.
# H200 compiles as the H100 target (the same sm_90a), with H200's HBM.
CHIPS = {
    "v5p-8": Chip("TPU v5p", 95.0, 459.0, "tpu", "v5p:2x2x1"),
    "v5p-32": Chip("TPU v5p", 95.0, 459.0, "tpu", "v5p:2x2x4"),
    "v6e-8": Chip("TPU v6e", 32.0, 918.0, "tpu", "v6e:2x4"),
    "h100x8": Chip("H100 SXM", 80e9 / GIB, 989.0, "gpu", "1x1x8"),
    "h200x8": Chip("H200 SXM", 141e9 / GIB, 989.0, "gpu", "1x1x8"),
}


def target_devices(chip: Chip) -> list:
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  if chip.platform == "tpu":
    return compile_mesh.tpu_devices(chip.topology)
  with open(compile_mesh.H100_SPEC) as f:
    return topologies.get_topology_desc(
        platform="cuda", target_config=f.read(),
        topology=chip.topology).devices


def model_config(name: str, layers: int, scan: bool
                 ) -> config_lib.ModelConfig:
  """`configs/<module>.py`'s `model_config(arg)`, cut to `layers`, read
  into its `ModelConfig`."""
  module, _, arg = name.partition(":")
  make = importlib.import_module(f"configs.{module}").model_config
  m = make(arg) if arg else make()
  if layers:
    m.attention_pattern = m.attention_pattern[:layers - 1] + "M"
  m.scan_layers = scan
  return config_lib.ModelConfig.from_config(m)


@dataclasses.dataclass
class Fit:
  """One compiled step's report."""
  args_gib: float = 0.0
  temp_gib: float = 0.0
  compiled_tflop: float = 0.0   # Matmul FLOPs of the compiled step.
  recompute_tflop: float = 0.0  # Their share that recomputes a forward.
  analytic_tflop: float = 0.0
  seconds: float = 0.0
  error: str = ""
  # Set when the float32 state and gradients alone exceed the chip's HBM:
  # the step is not compiled (no remat policy or batch can make it fit);
  # temp_gib then holds the gradients only.
  state_only: bool = False
  # Set when the compiler refused the step for want of HBM (the TPU
  # compiler does): temp_gib holds the temporaries it said it needs.
  out_of_hbm: bool = False

  @property
  def total_gib(self) -> float:
    return self.args_gib + self.temp_gib

  def fits(self, chip: Chip) -> bool:
    return (not self.error and not self.state_only and not self.out_of_hbm
            and self.total_gib <= chip.hbm_gib)


# The TPU compiler's refusal: "... the total memory required for HLO
# temporaries (125.16G) exceeds available HBM (95.74G)" (binary units).
_OUT_OF_HBM = re.compile(r"memory required for HLO temporaries "
                         r"\(([\d.]+)([KMGT])\)")


def out_of_hbm_gib(message: str):
  """The temporaries in GiB a compiler's out-of-HBM error names, or None."""
  found = _OUT_OF_HBM.search(message)
  if not found:
    return None
  return float(found.group(1)) * 1024.0 ** "KMGT".index(found.group(2)) / (
      1024.0 ** 2)


def _compile(m, mesh_text, chip, B, T, remat, accum, loss_chunks):
  """(compiled step, compile seconds) on the target's first devices."""
  return compile_mesh.compile_step(
      m, compile_mesh.parse_mesh(mesh_text),
      list(target_devices(chip))[:mesh_devices(mesh_text)], B, T,
      chip.platform, remat, accum, loss_chunks)


def state_and_grads_gib(m, mesh_text: str, chip: Chip) -> tuple:
  """GiB per device of the parameters and AdamW moments, and of the
  gradients, as the training state's shardings lay them out on the mesh
  (no compile)."""
  return compile_mesh.state_and_grads_gib(
      m, compile_mesh.parse_mesh(mesh_text),
      list(target_devices(chip))[:mesh_devices(mesh_text)])


def _save_hlo(hlo, m, mesh_text, chip, B, T, remat, accum, loss_chunks):
  """With `--hlo_dir`, the compiled step's HLO text, gzipped."""
  folder = flags.FLAGS.hlo_dir if "hlo_dir" in flags.FLAGS else None
  if not folder:
    return
  os.makedirs(folder, exist_ok=True)
  name = (f"{chip.topology}_{mesh_text}_L{len(m.attention_pattern)}_T{T}_"
          f"B{B}_{remat}_a{accum}_c{loss_chunks}_V{m.vocab_size}.hlo.gz")
  with gzip.open(os.path.join(folder, name.replace(":", "-")), "wt") as f:
    f.write(hlo)


def fit(m, mesh_text: str, chip: Chip, B: int, T: int, remat: str,
        accum: int, loss_chunks: int = 1) -> Fit:
  """Compiles one step and reads its memory and matmul FLOPs (counted
  from the optimized HLO, loops times their trip counts)."""
  out = Fit(analytic_tflop=compile_mesh.analytic_flops(m, B, T)
            / mesh_devices(mesh_text) / 1e12)
  out.args_gib, out.temp_gib = state_and_grads_gib(m, mesh_text, chip)
  if out.total_gib > chip.hbm_gib:
    out.state_only = True
    return out
  out.temp_gib = 0.0
  try:
    compiled, out.seconds = _compile(m, mesh_text, chip, B, T, remat, accum,
                                     loss_chunks)
    memory = compiled.memory_analysis()
    out.args_gib = memory.argument_size_in_bytes / GIB
    out.temp_gib = memory.temp_size_in_bytes / GIB
    hlo = compiled.as_text()
    _save_hlo(hlo, m, mesh_text, chip, B, T, remat, accum, loss_chunks)
    try:
      flops = hlo_flops.count(hlo)
    except ValueError as e:  # A loop form the count cannot read.
      logging.warning("FLOPs not counted: %s", e)
      return out
    out.compiled_tflop = flops.total / 1e12
    out.recompute_tflop = flops.recompute / 1e12
    cost = compiled.cost_analysis() or {}
    logging.info("matmul TFLOP from the HLO %.3f (recompute %.3f); XLA's "
                 "cost analysis %.3f (each loop body once, none on GPU)",
                 out.compiled_tflop, out.recompute_tflop,
                 float(cost.get("flops", 0.0)) / 1e12)
  except Exception as e:  # pylint: disable=broad-except
    needed = out_of_hbm_gib(str(e))
    if needed is not None:
      logging.info("The compiler refused the step: %s", str(e)[:300])
      out.temp_gib, out.out_of_hbm = needed, True
      return out
    traceback.print_exc()
    out.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
  return out


HEADER = ("| model | target | mesh | T | B | accum | remat | args GiB | "
          "temp GiB | total GiB / HBM | compiled TFLOP | recompute TFLOP | "
          "analytic TFLOP | ratio | roofline s | tok/s/chip | compile s | "
          "fits |")


# A fitting step with less HBM than this to spare says how little: the
# runtime holds some memory outside the compiled program (on GPU, CUDA's
# context; JAX's GPU client also preallocates only a fraction of the HBM
# unless XLA_CLIENT_MEM_FRACTION says more).
TIGHT_GIB = 2.0


def verdict(f: Fit, chip: Chip) -> str:
  """A compiled step's fits cell, its arguments + temporaries against the
  chip's HBM: `yes`, `yes, X GiB spare` (under TIGHT_GIB left) or `no, by
  X GiB`."""
  spare = chip.hbm_gib - f.total_gib
  if not f.fits(chip):
    return f"no, by {-spare:.1f} GiB"
  return "yes" if spare >= TIGHT_GIB else f"yes, {spare:.1f} GiB spare"


def row(name, target, mesh, T, B, accum, remat, chip, f: Fit) -> str:
  """One table row. The ratio is compiled FLOPs less recompute over the
  analytic count; the roofline step time counts every compiled FLOP."""
  head = f"| {name} | {target} | {mesh} | {T} | {B} | {accum} | {remat} |"
  if f.error:
    return (f"{head} - | - | - | - | - | {f.analytic_tflop:.1f} | - | - | "
            f"- | - | error: {f.error} |")
  if f.state_only:
    return (f"{head} {f.args_gib:.2f} | > {f.temp_gib:.2f} | > "
            f"{f.total_gib:.1f} / {chip.hbm_gib:.0f} | - | - | "
            f"{f.analytic_tflop:.1f} | - | - | - | - | no: the float32 "
            f"parameters, gradients and AdamW moments alone take "
            f"{f.total_gib:.1f} GiB per device (not compiled) |")
  memory = (f"{head} {f.args_gib:.2f} | {f.temp_gib:.2f} | "
            f"{f.total_gib:.1f} / {chip.hbm_gib:.0f} |")
  fits = verdict(f, chip)
  if f.out_of_hbm:
    return (f"{memory} - | - | {f.analytic_tflop:.1f} | - | - | - | - | "
            f"no: the compiler needs {f.temp_gib:.2f} GiB of temporaries "
            f"(arguments: the state's) |")
  if not f.compiled_tflop:  # Not counted (logged why).
    return (f"{memory} - | - | {f.analytic_tflop:.1f} | - | - | - | "
            f"{f.seconds:.0f} | {fits} |")
  step_s = f.compiled_tflop / chip.peak_tflops
  tokens = B * T / mesh_devices(mesh)
  ratio = (f.compiled_tflop - f.recompute_tflop) / f.analytic_tflop
  return (f"{memory} {f.compiled_tflop:.1f} | {f.recompute_tflop:.1f} | "
          f"{f.analytic_tflop:.1f} | {ratio:.2f} | {step_s:.2f} | "
          f"{tokens / step_s:,.0f} | {f.seconds:.0f} | {fits} |")


def mesh_devices(mesh_text: str) -> int:
  c = compile_mesh.parse_mesh(mesh_text)
  return c.data * c.fsdp * c.expert * c.context


def _report(m, chip, B, remat) -> Fit:
  F = flags.FLAGS  # pylint: disable=invalid-name
  f = fit(m, F.mesh, chip, B, F.seq_len, remat, F.grad_accum,
          F.loss_chunks)
  label = remat if F.loss_chunks == 1 else (
      f"{remat}, loss in {F.loss_chunks}")
  print(row(F.model, F.target, F.mesh, F.seq_len, B, F.grad_accum, label,
            chip, f), flush=True)
  return f


def grow(report, chip: Chip, B: int) -> int:
  """The largest batch, doubling from B (which fits), whose step fits;
  `report(B)` compiles and prints one row."""
  while report(2 * B).fits(chip):
    B *= 2
  return B


def main(argv):
  del argv
  F = flags.FLAGS  # pylint: disable=invalid-name
  chip = CHIPS[F.target]
  m = model_config(F.model, F.layers, F.scan)
  print(f"jax {jax.__version__}; {F.model}: "
        f"{len(m.attention_pattern)} layers, scan_layers={F.scan}, "
        f"{m.compute_dtype} activations; {F.target} ({chip.name}, "
        f"{chip.hbm_gib:.0f} GiB, {chip.peak_tflops:.0f} TFLOP/s bf16)",
        flush=True)
  print(HEADER)
  print("|" + "---|" * 18, flush=True)
  policies = config_lib.REMAT_POLICIES if F.search else (F.remat,)
  for remat in policies:
    report = _report(m, chip, F.batch, remat)
    if report.state_only:
      return 1
    if report.fits(chip):
      if F.grow:
        B = grow(functools.partial(_report, m, chip, remat=remat), chip,
                 F.batch)
        rows = B // F.grad_accum
        print(f"largest micro-batch that fits with remat={remat}: {rows} "
              f"rows ({rows / mesh_devices(F.mesh):g} per device; "
              f"batch {B}, grad_accum={F.grad_accum}); twice as many do "
              f"not fit", flush=True)
      return 0
  return 1


def define_flags():
  """The command's flags (defined only when run: tests import this
  module's functions next to other experiments' flags)."""
  flags.DEFINE_string("model", "ling3:tiny", "configs module[:arg]: "
                      "ling3:tiny, ling3:flash, kimi_linear.")
  flags.DEFINE_string("target", "v5p-8", "A key of CHIPS' slices.")
  flags.DEFINE_string("mesh", "fsdp=4", "Axis sizes, e.g. data=2+fsdp=2 "
                      "(missing axes 1).")
  flags.DEFINE_integer("seq_len", 4096, "T, tokens per row.")
  flags.DEFINE_integer("batch", 4, "Global rows per optimizer step.")
  flags.DEFINE_enum("remat", "none", config_lib.REMAT_POLICIES,
                    "config.train.remat.")
  flags.DEFINE_integer("grad_accum", 1, "config.train.grad_accum_steps.")
  flags.DEFINE_integer("loss_chunks", 1, "config.train.loss_chunks (the "
                       "remat column then reads `<remat>, loss in <n>`).")
  flags.DEFINE_bool("search", False, "Try the remat policies in order and "
                    "stop at the first that fits.")
  flags.DEFINE_bool("grow", False, "Double --batch while the step fits; "
                    "report the largest micro-batch.")
  flags.DEFINE_integer("layers", 0, "Cut to n layers (0 = all).")
  flags.DEFINE_string("hlo_dir", None, "Save each compiled step's HLO text "
                      "here (gzipped), to recount or inspect it.")
  flags.DEFINE_bool("scan", True, "config.model.scan_layers.")


if __name__ == "__main__":
  define_flags()
  app.run(lambda argv: sys.exit(main(argv)))
