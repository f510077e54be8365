"""Kernel settings of the Pallas KDA op: a typed, hashable options object.

`KernelOptions` is a static argument of the jitted op (a frozen dataclass,
so equal settings share one compiled executable and different ones
retrace). `for_platform` gives the settings a GPU, TPU or CPU run uses:

  >>> from kda_lm.ops.kda import pallas
  >>> pallas.for_platform("gpu")
  KernelOptions(num_warps=8, num_stages=1, v_block=64, k_block=32,
                precision='bf16', recurrence='loop', interpret=False)

`chunk_kda(..., pallas_options=...)` takes one explicitly. Without it the op
uses `default_options()`: `for_platform` of JAX's default backend, with the
`KDA_LM_PALLAS_*` environment variables (read only there) overriding single
fields for experiments.
"""

import dataclasses
import os

import jax

PRECISIONS = ("highest", "tf32", "bf16")
RECURRENCES = ("loop", "grid")
PLATFORMS = ("gpu", "tpu", "cpu")

INTERPRET_ENV = "KDA_LM_PALLAS_INTERPRET"
NUM_WARPS_ENV = "KDA_LM_PALLAS_NUM_WARPS"
V_BLOCK_ENV = "KDA_LM_PALLAS_V_BLOCK"
RECURRENCE_ENV = "KDA_LM_PALLAS_RECURRENCE"
PRECISION_ENV = "KDA_LM_PALLAS_PRECISION"


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
  """
  num_warps: int = 4
  num_stages: int = 1
  v_block: int = 64
  k_block: int = 32
  precision: str = "highest"
  recurrence: str = "loop"
  interpret: bool = False

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
    if self.precision not in PRECISIONS:
      bad("precision", f"one of {PRECISIONS}")
    if self.recurrence not in RECURRENCES:
      bad("recurrence", f"one of {RECURRENCES}")
    if not isinstance(self.interpret, bool):
      bad("interpret", "a bool")


def _is_int(x):
  return isinstance(x, int) and not isinstance(x, bool)


def for_platform(platform):
  """The default settings for "gpu", "tpu" or "cpu" (interpret mode).

  GPU: bfloat16 tensor-core dots with float32 accumulation (FLA's form;
  the gate cumsum stays float32-exact) and 8 warps, the settings at which
  every kernel compiles for sm_90a within shared memory and spills at most
  1 KB per thread (experiments/compile_check.py). TPU: float32
  dots at HIGHEST (the kernels fit VMEM on v5e and v6e). CPU: interpret
  mode with IEEE float32 dots, the form the tests check against the
  reference.

  Raises:
    ValueError: an unknown platform.
  """
  if platform == "gpu":
    return KernelOptions(num_warps=8, num_stages=1, precision="bf16")
  if platform == "tpu":
    return KernelOptions(precision="highest", recurrence="grid")
  if platform == "cpu":
    return KernelOptions(precision="highest", k_block=16, interpret=True)
  raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}.")


def backend_platform(backend=None):
  """Maps a JAX backend name (default: JAX's default backend) to a platform
  of `for_platform`: "tpu", "cpu", else "gpu" (cuda, rocm, gpu)."""
  backend = jax.default_backend() if backend is None else backend
  return backend if backend in ("tpu", "cpu") else "gpu"


def default_options():
  """`for_platform(backend_platform())` with the environment's overrides.

  KDA_LM_PALLAS_INTERPRET=0|1, KDA_LM_PALLAS_NUM_WARPS, KDA_LM_PALLAS_V_BLOCK,
  KDA_LM_PALLAS_RECURRENCE=loop|grid and KDA_LM_PALLAS_PRECISION=highest|
  tf32|bf16 each replace one field. This is the only place that reads them.

  Raises:
    ValueError: a malformed environment variable.
  """
  options = for_platform(backend_platform())
  changes = {}
  env = {name: os.environ.get(name, "") for name in (
      INTERPRET_ENV, NUM_WARPS_ENV, V_BLOCK_ENV, RECURRENCE_ENV,
      PRECISION_ENV)}
  if env[INTERPRET_ENV]:
    if env[INTERPRET_ENV] not in ("0", "1"):
      raise ValueError(f"{INTERPRET_ENV} must be 0 or 1, got "
                       f"{env[INTERPRET_ENV]!r}.")
    changes["interpret"] = env[INTERPRET_ENV] == "1"
  for name, field in ((NUM_WARPS_ENV, "num_warps"),
                      (V_BLOCK_ENV, "v_block")):
    if env[name]:
      if not env[name].isdigit():
        raise ValueError(f"{name} must be a positive int, got {env[name]!r}.")
      changes[field] = int(env[name])
  for name, field in ((RECURRENCE_ENV, "recurrence"),
                      (PRECISION_ENV, "precision")):
    if env[name]:
      changes[field] = env[name]
  try:
    return dataclasses.replace(options, **changes)
  except ValueError as e:
    raise ValueError(f"KDA_LM_PALLAS_* environment override: {e}") from e
