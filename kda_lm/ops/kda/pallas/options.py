"""Kernel settings of the Pallas KDA op: a typed, hashable options object.

`KernelOptions` is a static argument of the jitted op (a frozen dataclass,
so equal settings share one compiled executable and different ones
retrace). `for_platform` gives the settings a GPU, TPU or CPU run uses:

  >>> from kda_lm.ops.kda import pallas
  >>> pallas.for_platform("gpu")
  KernelOptions(num_warps=8, num_stages=1, v_block=64, k_block=32,
                precision='bf16', recurrence='loop', interpret=False)

`chunk_kda(..., pallas_options=...)` takes one explicitly. Without it the op
uses `default_options()`: `for_platform` of JAX's default backend. A model
takes its settings from `config.model.kda_kernel` (`KernelSettings`: any
field, over the platform's defaults). Nothing here reads the environment.
"""

import dataclasses
import typing
from typing import Optional

import jax

from kda_lm.ops.kda.pallas import tpu_chunk

PRECISIONS = ("highest", "tf32", "bf16")
TPU_PRECISIONS = tpu_chunk.PRECISIONS   # ("highest", "bf16_3x", "bf16")
RECURRENCES = ("loop", "grid")
FAMILIES = ("generic", "tpu")
PLATFORMS = ("gpu", "tpu", "cpu")



@dataclasses.dataclass(frozen=True)
class KernelOptions:
  """How the Pallas KDA kernels are built.

  Attributes:
    num_warps: Triton warps per program (GPU): 1, 2, 4, 8 or 16.
    num_stages: Triton software-pipelining stages (GPU), >= 1.
    v_block: state columns (of V) per recurrence program, a power of two
      >= 16 (GPU and interpret mode; TPU always takes the whole V).
    k_block: K columns per program of the backward's per-chunk gradient
      kernel, a power of two >= 16 (GPU and interpret mode; TPU takes the
      whole K).
    precision: in-kernel dots. "highest": IEEE float32 (slow on GPU: no
      tensor cores, many registers). "tf32": float32 operands at the
      backend's fast float32 (TF32 tensor cores on GPU, one bfloat16 pass
      on TPU). "bf16": operands rounded to bfloat16, products accumulated
      in float32 (FLA's Triton dots for bfloat16 inputs); interpret mode
      reproduces its rounding on CPU.
    recurrence: "loop" (the GPU form: one program per V block loops over the
      chunks) or "grid" (the TPU form: one chunk per step of a sequential
      grid axis, the state in scratch). Only interpret mode can choose;
      compiled kernels take their platform's form.
    interpret: run the kernels in Pallas interpret mode (CPU).
    family: "generic" (the kernels shared by Triton and Mosaic: GPU) or
      "tpu" (the TPU kernels of `tpu.py`: one forward and one backward
      kernel, several heads per program; they need bounded gates, i.e.
      `lower_bound`, and fall back to "generic" for unbounded gates and
      off TPU). With "tpu", `precision` is one of `TPU_PRECISIONS` and sets
      the chunk-local dots.
    heads_per_program: heads per forward program ("tpu"; the largest
      divisor of H up to this).
    bwd_heads_per_program: heads per backward program ("tpu").
    inverse_heads: "tpu": heads whose triangular inverses share one
      block-diagonal matrix (2: 128 x 128, the MXU's width); divides the
      heads per program.
    state_precision: "tpu": the dots with the carried state; None = as
      `precision`.
    gate_grad_precision: "tpu": the backward's decayed products, whose
      terms cancel in the gate gradient (bfloat16 operands there give ~1e-2
      error in dg); None = "highest" if `precision` is, else "bf16_3x".
    vmem_limit_mib: "tpu": the kernels' scoped-VMEM limit (v5e, v5p and v6e
      have 128 MiB or more of VMEM).
  """
  num_warps: int = 4
  num_stages: int = 1
  v_block: int = 64
  k_block: int = 32
  precision: str = "highest"
  recurrence: str = "loop"
  interpret: bool = False
  family: str = "generic"
  heads_per_program: int = 8
  bwd_heads_per_program: int = 8
  inverse_heads: int = 2
  state_precision: Optional[str] = None
  gate_grad_precision: Optional[str] = None
  vmem_limit_mib: int = 64

  def __post_init__(self):
    def bad(name, what):
      value = getattr(self, name)
      raise ValueError(f"KernelOptions.{name} must be {what}, got {value!r}.")
    if self.num_warps not in (1, 2, 4, 8, 16):
      bad("num_warps", "one of 1, 2, 4, 8, 16")
    if not _is_int(self.num_stages) or self.num_stages < 1:
      bad("num_stages", "an int >= 1")
    if (not _is_int(self.v_block) or self.v_block < 16
        or self.v_block & (self.v_block - 1)):
      bad("v_block", "a power of two >= 16")
    if (not _is_int(self.k_block) or self.k_block < 16
        or self.k_block & (self.k_block - 1)):
      bad("k_block", "a power of two >= 16")
    if self.family not in FAMILIES:
      bad("family", f"one of {FAMILIES}")
    allowed = TPU_PRECISIONS if self.family == "tpu" else PRECISIONS
    if self.precision not in allowed:
      bad("precision", f"one of {allowed} (family {self.family!r})")
    for name in ("state_precision", "gate_grad_precision"):
      if getattr(self, name) not in (None,) + TPU_PRECISIONS:
        bad(name, f"None or one of {TPU_PRECISIONS}")
    for name in ("heads_per_program", "bwd_heads_per_program",
                 "inverse_heads", "vmem_limit_mib"):
      if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
        bad(name, "an int >= 1")
    if self.recurrence not in RECURRENCES:
      bad("recurrence", f"one of {RECURRENCES}")
    if not isinstance(self.interpret, bool):
      bad("interpret", "a bool")


  def tpu_precisions(self):
    """The `tpu_chunk.Precisions` of the "tpu" family."""
    gate_grad = self.gate_grad_precision or (
        "highest" if self.precision == "highest" else "bf16_3x")
    return tpu_chunk.Precisions(
        chunk=self.precision, state=self.state_precision or self.precision,
        gate_grad=gate_grad)


  def generic(self):
    """These options for the "generic" kernels (the fallback of "tpu")."""
    precision = self.precision if self.precision in PRECISIONS else "highest"
    return dataclasses.replace(self, family="generic", precision=precision)


def _is_int(x):
  return isinstance(x, int) and not isinstance(x, bool)


def for_platform(platform):
  """The default settings for "gpu", "tpu" or "cpu" (interpret mode).

  GPU: bfloat16 tensor-core dots with float32 accumulation (FLA's form;
  the gate cumsum stays float32-exact) and 8 warps, the settings at which
  every kernel compiles for sm_90a within shared memory and spills at most
  1 KB per thread (experiments/compile_check.py). TPU: the "tpu" family
  with bfloat16 dots and float32 accumulation (the gate cumsum exact, the
  gate gradient's products at "bf16_3x"); set precision="highest" for IEEE
  float32 throughout. CPU: interpret
  mode with IEEE float32 dots, the form the tests check against the
  reference.

  Raises:
    ValueError: an unknown platform.
  """
  if platform == "gpu":
    return KernelOptions(num_warps=8, num_stages=1, precision="bf16")
  if platform == "tpu":
    return KernelOptions(family="tpu", precision="bf16", recurrence="grid")
  if platform == "cpu":
    return KernelOptions(precision="highest", k_block=16, interpret=True)
  raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}.")


def backend_platform(backend=None):
  """Maps a JAX backend name (default: JAX's default backend) to a platform
  of `for_platform`: "tpu", "cpu", else "gpu" (cuda, rocm, gpu)."""
  backend = jax.default_backend() if backend is None else backend
  return backend if backend in ("tpu", "cpu") else "gpu"


def default_options():
  """`for_platform(backend_platform())`: the settings of JAX's default
  backend (`KernelSettings` or an explicit `KernelOptions` change them)."""
  return for_platform(backend_platform())


def _settings_post_init(self):
  """Checks each set field as `KernelOptions` would (raises ValueError)."""
  changes = self.changes()
  family = changes.get("family", "tpu")
  base = for_platform("tpu" if family == "tpu" else "gpu")
  try:
    dataclasses.replace(base, **changes)
  except ValueError as e:
    raise ValueError(f"config.model.kda_kernel: {e}") from e


def _settings_changes(self):
  """{field: value} of the fields that are set (not 0 or "")."""
  return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
          if getattr(self, f.name) not in (0, "")}


def _settings_options(self):
  """`default_options()` with the set fields replaced, or None when none
  is set (the op then takes the platform's defaults itself)."""
  changes = self.changes()
  return dataclasses.replace(default_options(), **changes) if changes else (
      None)


def _settings_fields():
  """KernelOptions' fields as settings: ints default to 0 and strings to
  "", meaning "the platform's default" (no None: a nested ConfigDict update
  cannot carry None fields). `interpret` stays the platform's choice."""
  out = []
  for name, hint in typing.get_type_hints(KernelOptions).items():
    if hint is bool:
      continue
    kind = int if hint is int else str
    out.append((name, kind, dataclasses.field(default=kind())))
  return out


# `config.model.kda_kernel`: any `KernelOptions` field but `interpret`, 0
# or "" = the platform's default (`for_platform`). Recorded with the run's
# config; a resume may change it (speed and rounding, not what the state
# means). One field per `KernelOptions` field, so the two never drift.
KernelSettings = dataclasses.make_dataclass(
    "KernelSettings", _settings_fields(), frozen=True,
    namespace={"__post_init__": _settings_post_init,
               "changes": _settings_changes, "options": _settings_options,
               "__doc__": "KernelOptions fields to set over the platform's "
                          "defaults (0 or \"\" keeps the default)."})
