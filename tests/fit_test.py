"""Tests of experiments/fit.py's reporting (the compiles themselves run in
the compile check's environment: docs/scale.md)."""

import jax
import numpy as np

from experiments import compile_mesh, fit

CHIP = fit.CHIPS["v6e-8"]


def _row(f, mesh="fsdp=8"):
  return fit.row("ling3:tiny", "v6e-8", mesh, 4096, 8, 1, "none", CHIP, f)


def test_ratio_leaves_out_the_recompute():
  f = fit.Fit(args_gib=11.0, temp_gib=13.0, compiled_tflop=45.0,
              recompute_tflop=6.0, analytic_tflop=30.0)
  cells = [c.strip() for c in _row(f).split("|")]
  # compiled, recompute, analytic, (45 - 6) / 30, 45 / 918 s.
  assert cells[11:16] == ["45.0", "6.0", "30.0", "1.30", "0.05"], cells
  assert cells[-2] == "yes"
  cells = [c.strip() for c in _row(fit.Fit(
      args_gib=11.0, temp_gib=22.0, compiled_tflop=30.0,
      analytic_tflop=30.0)).split("|")]
  assert cells[-2] == "no, by 1.0 GiB"  # 33 GiB > 32
  uncounted = _row(fit.Fit(args_gib=11.0, temp_gib=13.0, analytic_tflop=30.0))
  assert [c.strip() for c in uncounted.split("|")][11:14] == ["-", "-",
                                                              "30.0"]
  assert len(uncounted.split("|")) == len(fit.HEADER.split("|"))
  error = _row(fit.Fit(analytic_tflop=30.0, error="boom"))
  assert "error: boom" in error
  assert len(error.split("|")) == len(fit.HEADER.split("|"))


def test_the_verdict_says_how_near_the_hbm_a_step_is():
  assert fit.verdict(fit.Fit(args_gib=11.0, temp_gib=19.0), CHIP) == "yes"
  assert fit.verdict(fit.Fit(args_gib=11.0, temp_gib=19.5), CHIP) == (
      "yes, 1.5 GiB spare")
  assert fit.verdict(fit.Fit(args_gib=11.0, temp_gib=21.0), CHIP) == (
      "yes, 0.0 GiB spare")
  assert fit.verdict(fit.Fit(args_gib=11.0, temp_gib=23.44), CHIP) == (
      "no, by 2.4 GiB")


def test_the_compilers_out_of_hbm_refusal_is_a_row_that_does_not_fit():
  message = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
             "required for HLO temporaries (125.16G) exceeds available HBM "
             "(95.74G).")
  assert fit.out_of_hbm_gib(message) == 125.16
  assert fit.out_of_hbm_gib(
      "memory required for HLO temporaries (512.00M)") == 0.5
  assert fit.out_of_hbm_gib("INTERNAL: something else") is None
  f = fit.Fit(args_gib=11.0, temp_gib=125.16, analytic_tflop=30.0,
              out_of_hbm=True)
  assert not f.fits(fit.CHIPS["v5p-8"]) and not f.fits(CHIP)
  assert not fit.Fit(args_gib=1.0, temp_gib=1.0, out_of_hbm=True).fits(CHIP)
  cells = [c.strip() for c in _row(f).split("|")]
  assert len(cells) == len(fit.HEADER.split("|"))
  assert cells[8:11] == ["11.00", "125.16", "136.2 / 32"], cells
  assert cells[-2].startswith("no: the compiler needs 125.16 GiB"), cells


def test_grow_doubles_while_the_step_fits():
  tried = []

  def report(B):
    tried.append(B)
    return fit.Fit(args_gib=10.0, temp_gib=2.0 * B)  # fits up to B = 11

  assert fit.grow(report, CHIP, 2) == 8
  assert tried == [4, 8, 16]
  assert fit.mesh_devices("fsdp=2+context=4") == 8


def test_state_alone_over_hbm_is_reported_without_a_compile():
  f = fit.Fit(args_gib=20.0, temp_gib=13.0, analytic_tflop=30.0,
              state_only=True)
  assert not f.fits(CHIP)
  cells = [c.strip() for c in _row(f).split("|")]
  assert cells[8:11] == ["20.00", "> 13.00", "> 33.0 / 32"], cells
  assert cells[-2].startswith("no: the float32 parameters, gradients and "
                              "AdamW moments alone take 33.0 GiB"), cells
  # Under the HBM, the same numbers would fit: only the flag refuses.
  assert fit.Fit(args_gib=20.0).fits(CHIP)


def test_state_floor_adds_one_float32_gradient_per_parameter():
  m = fit.model_config("ling3:tiny", 2, True)
  mesh = compile_mesh.parse_mesh("fsdp=1")
  devs = jax.devices()[:1]
  state, grads = compile_mesh.state_and_grads_gib(m, mesh, devs)
  assert state == compile_mesh.state_gib(m, mesh, devs)
  params = jax.eval_shape(
      compile_mesh.model_lib.build(m).init, jax.random.PRNGKey(0),
      np.zeros((1, 8), np.int32))
  gib = sum(a.size * a.dtype.itemsize
            for a in jax.tree.leaves(params)) / fit.GIB
  assert abs(grads - gib) <= 1e-9 * gib, (grads, gib)
  # Parameters and two AdamW moments, all float32, and a few scalars.
  assert abs(state - 3 * gib) <= 1e-6 * gib, (state, gib)
