"""Tests of experiments/fit.py's reporting (the compiles themselves run in
the compile check's environment: docs/scale.md)."""

from experiments import fit

CHIP = fit.CHIPS["v6e-8"]


def _row(f, mesh="fsdp=8"):
  return fit.row("ling3:tiny", "v6e-8", mesh, 4096, 8, 1, "none", CHIP, f)


def test_ratio_only_when_the_flops_count_every_layer():
  flat = fit.Fit(args_gib=11.0, temp_gib=13.0, compiled_tflop=39.0,
                 analytic_tflop=30.0)
  cells = [c.strip() for c in _row(flat).split("|")]
  assert cells[11:14] == ["39.0", "30.0", "1.30"], cells
  assert cells[-2] == "yes"
  # A scanned step's cost analysis counts the loop body once: no ratio,
  # and the roofline falls back to the analytic FLOPs.
  scanned = fit.Fit(args_gib=11.0, temp_gib=22.0, compiled_tflop=5.0,
                    analytic_tflop=30.0, flops_complete=False)
  cells = [c.strip() for c in _row(scanned).split("|")]
  assert cells[11:15] == ["-", "30.0", "-", f"{30.0 / 918.0:.2f}"], cells
  assert cells[-2] == "no"  # 33 GiB > 32
  assert "error: boom" in _row(fit.Fit(analytic_tflop=30.0, error="boom"))


def test_grow_doubles_while_the_step_fits():
  tried = []

  def report(B):
    tried.append(B)
    return fit.Fit(args_gib=10.0, temp_gib=2.0 * B)  # fits up to B = 11

  assert fit.grow(report, CHIP, 2) == 8
  assert tried == [4, 8, 16]
  assert fit.mesh_devices("fsdp=2+context=4") == 8


def test_state_alone_over_hbm_is_reported_without_a_compile():
  f = fit.Fit(args_gib=67.0, analytic_tflop=30.0, state_only=True)
  assert not f.fits(CHIP)
  cells = [c.strip() for c in _row(f).split("|")]
  assert cells[8:11] == ["67.00", "-", "> 67.0 / 32"], cells
  assert cells[-2].startswith("no: the float32 parameters and AdamW "
                              "moments alone take 67.0 GiB"), cells
  # Under the HBM, the same numbers would fit: only the flag refuses.
  assert fit.Fit(args_gib=20.0).fits(CHIP)
