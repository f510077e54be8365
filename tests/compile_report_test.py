"""Tests of testbed/compile_report.py: the parsing and limits of the
deviceless compile check (the check itself runs in its own environment:
`.ci/run`, experiments/compile_check.py). The log lines are the formats
XLA's ptxas step (TF_CPP_VMODULE=subprocess_compilation=2) and its thunk
sequence dump print."""

from kda_lm.ops import gmm
from testbed import compile_report

PTXAS_LOG = """\
I1202 subprocess_compilation.cc:349] ptxas warning : Registers are spilled
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'intra_kernel' for 'sm_90a'
ptxas info    : Function properties for intra_kernel
    1344 bytes stack frame, 1344 bytes spill stores, 1540 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 1344 bytes stack
ptxas info    : Compiling entry function 'out_kernel' for 'sm_90a'
ptxas info    : Function properties for out_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers
"""

THUNKS = """\
001: kCustomKernel [source | sink] intra_kernel grid: [1, 16, 128] \
threads: [256, 1, 1]  shared_memory: 36864 bytes
002: kCustomKernel [source | sink] out_kernel grid: [1, 16, 128] \
threads: [256, 1, 1]  shared_memory: 65536 bytes
"""


def test_parse_ptxas_per_entry_function():
  assert compile_report.parse_ptxas(PTXAS_LOG) == {
      "intra_kernel": (255, 1344, 1540), "out_kernel": (128, 0, 0)}
  assert compile_report.parse_ptxas("no ptxas here") == {}


def test_parse_thunks():
  assert compile_report.parse_thunks(THUNKS) == [
      ("intra_kernel", (1, 16, 128), 256, 36864),
      ("out_kernel", (1, 16, 128), 256, 65536)]


def test_limits_fail_oversized_kernels():
  """Shared memory over the opt-in limit and spills over 1 KB per thread
  (stores or loads) are failures; at the limits is fine."""
  limit = 232448
  assert not compile_report.gpu_problems(limit, limit, (1024, 1024), 1024)
  assert compile_report.gpu_problems(limit + 1, limit, (0, 0), 1024) == [
      "shared memory 232449 > 232448"]
  assert compile_report.gpu_problems(36864, limit, (1344, 1540), 1024) == [
      "spills 1344/1540 B > 1024"]
  assert compile_report.gpu_problems(0, limit, (0, 1025), 1024)


# Lines in the form of a compiled module's HLO text (`compiled.as_text()`).
COLLECTIVES = "\n".join([
    "  %all-gather.1 = bf16[512,2560,768]{2,1,0} all-gather(bf16[128,2560,"
    "768]{2,1,0} %p), channel_id=1, replica_groups=[4,4]<=[16], "
    "dimensions={0}",
    "  %ag-start = (bf16[8,16]{1,0}, bf16[32,16]{1,0}) all-gather-start("
    "bf16[8,16]{1,0} %x), dimensions={0}",
    "  %ag-done = bf16[32,16]{1,0} all-gather-done((bf16[8,16]{1,0}, "
    "bf16[32,16]{1,0}) %ag-start)",
    "  %a2a = (f32[2,4]{1,0}, s32[2,4]{1,0}) all-to-all(f32[2,4]{1,0} %a, "
    "s32[2,4]{1,0} %b), replica_groups={{0,1}}",
    "  ROOT %ar = f32[] all-reduce(f32[] %z), to_apply=%add",
    "  %rs = f32[4,8]{1,0} reduce-scatter(f32[16,8]{1,0} %g), "
    "dimensions={0}",
    "  %fusion = f32[3]{0} fusion(f32[3]{0} %all-gather.1), kind=kLoop"])


def test_collective_ops_and_bytes():
  """Each collective's result arrays on one device; an asynchronous pair
  once (at its -done); operands and fusions that read a collective are
  not collectives."""
  assert compile_report.collective_ops(COLLECTIVES) == [
      ("all-gather", "bf16", (512, 2560, 768), 512 * 2560 * 768 * 2),
      ("all-gather", "bf16", (32, 16), 32 * 16 * 2),
      ("all-to-all", "f32", (2, 4), 32), ("all-to-all", "s32", (2, 4), 32),
      ("all-reduce", "f32", (), 4),
      ("reduce-scatter", "f32", (4, 8), 128)]
  assert compile_report.collective_bytes(COLLECTIVES) == {
      "all-gather": 512 * 2560 * 768 * 2 + 1024, "all-to-all": 64,
      "all-reduce": 4, "reduce-scatter": 128}
  experts = compile_report.collective_bytes(
      COLLECTIVES, lambda kind, dt, dims: dims == (512, 2560, 768))
  assert experts == {"all-gather": 512 * 2560 * 768 * 2}
  assert compile_report.collective_bytes("no collectives") == {}


def test_a_ragged_exchange_counts_the_rows_that_arrive():
  """A ragged all-to-all moves only its real rows: where its name scope
  states R of its result's M rows (the expert exchange's mean fill), R/M
  of the result counts; without the scope, or for another row count, the
  whole result."""
  line = ('  %r = bf16[1024,64]{1,0} ragged-all-to-all(%a, %b, %c, %d, %e, '
          '%f), replica_groups={{0,1}}, metadata={op_name="jit(u)/'
          'transpose(jvp(moe))/SCOPE/x"}')
  full = 1024 * 64 * 2
  for scope, want in ((gmm.ROWS_SCOPE.format(256, 1024), full // 4),
                      (gmm.ROWS_SCOPE.format(256, 2048), full),
                      ("moe", full)):
    assert compile_report.collective_ops(line.replace("SCOPE", scope)) == [
        ("ragged-all-to-all", "bf16", (1024, 64), want)]
