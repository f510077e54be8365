"""Tests of testbed/hlo_flops.py: matmul FLOPs from optimized HLO (and
of the script that prints them, experiments/hlo_flops.py)."""

import os

import jax
import jax.numpy as jnp
import process_support
import pytest

from experiments import hlo_flops as hlo_flops_script
from kda_lm.ops import gmm
from testbed import hlo_flops

L, B, W = 5, 8, 64  # Layers scanned, rows, width.


def _loss(w_LWW, x_BW):
  def body(h_BW, w_WW):
    return jnp.tanh(h_BW @ w_WW), None
  h_BW, _ = jax.lax.scan(body, x_BW, w_LWW)
  return jnp.sum(h_BW)


def _compiled(fn):
  return jax.jit(fn).lower(jnp.ones((L, W, W)), jnp.ones((B, W))).compile()


def test_a_scanned_loop_counts_every_trip():
  compiled = _compiled(jax.grad(_loss))
  # Forward h @ w, backward dh @ w^T and h^T @ dh: 3 matmuls a layer.
  expected = 3 * L * 2 * B * W * W
  assert hlo_flops.count(compiled.as_text()).total == expected
  # XLA's own cost analysis counts each loop's body once.
  assert compiled.cost_analysis()["flops"] < expected / 2


def test_unrolled_matches_the_dots():
  def unrolled(w_LWW, x_BW):
    for i in range(L):
      x_BW = jnp.tanh(x_BW @ w_LWW[i])
    return jnp.sum(x_BW)

  compiled = _compiled(jax.grad(unrolled))
  # As scanned, less the first layer's input gradient (x is no argument
  # of the gradient: unrolled, XLA drops it).
  flops = hlo_flops.count(compiled.as_text()).total
  assert flops == (3 * L - 1) * 2 * B * W * W


def _two_scopes(w_LWW, x_BW):
  with jax.named_scope("first"):
    x_BW = x_BW @ w_LWW[0]
  with jax.named_scope("second"):
    return jnp.sum(jnp.tanh(x_BW) @ w_LWW[1] @ w_LWW[2])


def test_a_scope_counts_its_own_matmuls(tmp_path, capsys):
  text = jax.jit(_two_scopes).lower(
      jnp.ones((L, W, W)), jnp.ones((B, W))).compile().as_text()
  one = 2 * B * W * W
  assert hlo_flops.count(text, scope="first").total == one
  assert hlo_flops.count(text, scope="second").total == 2 * one
  assert hlo_flops.count(text, scope="third").total == 0
  path = tmp_path / "step.hlo"
  path.write_text(text)
  hlo_flops_script.main(["--scope=second", str(path)])
  # In all, then within the scope.
  lines = capsys.readouterr().out.splitlines()
  assert [line.split(": ")[0] for line in lines] == [
      str(path), f"{path} [second]"]
  with pytest.raises(SystemExit, match="usage"):
    hlo_flops_script.main(["--scope=second"])


def test_a_loop_without_a_trip_count_is_refused():
  def until(w_LWW, x_BW):
    return jax.lax.while_loop(lambda h: jnp.sum(h) < 1e3,
                              lambda h: h @ w_LWW[0] + 1.0, x_BW).sum()

  with pytest.raises(ValueError, match="known trip count"):
    hlo_flops.count(_compiled(until).as_text())


def test_the_grouped_matmul_loop_counts_at_its_bound():
  M, K, N, G, tm = 64, 16, 8, 4, 8
  items = M // tm + G - 1  # Every group starting mid-tile.

  def loss(lhs_MK, rhs_GKN, sizes_G):
    out = gmm.gmm(lhs_MK, rhs_GKN, sizes_G, impl="xla", tile_m=tm)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  args = (jnp.ones((M, K)), jnp.ones((G, K, N)),
          jnp.array([16, 16, 16, 16]))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
  # Forward, input gradient and weight gradient: 2*tm*K*N per item each.
  assert hlo_flops.count(compiled.as_text()).total == 3 * items * 2 * tm * K * N


def test_a_checkpoint_replay_is_counted_as_recompute():
  def remat_loss(w_LWW, x_BW):
    def body(h_BW, w_WW):
      return jax.checkpoint(lambda h, w: jnp.tanh(h @ w))(h_BW, w_WW), None
    h_BW, _ = jax.lax.scan(body, x_BW, w_LWW)
    return jnp.sum(h_BW)

  flops = hlo_flops.count(_compiled(jax.grad(remat_loss)).as_text())
  # Forward, its replay and the two backward matmuls, per layer.
  assert flops == (4 * L * 2 * B * W * W, L * 2 * B * W * W)
  plain = hlo_flops.count(_compiled(jax.grad(_loss)).as_text())
  assert plain.recompute == 0


# Lines in the TPU compiler's format (tests/testdata/README.md).
TPU_HLO = os.path.join(process_support.REPO, "tests", "testdata",
                       "tpu_like.hlo")


def test_the_tpu_compilers_forms():
  with open(TPU_HLO) as f:
    flops = hlo_flops.count(f.read())
  loop = 6 * 2 * 256 * 16 * 128 * 1536  # One tap per output position.
  batched = 2 * 16 * 256 * 256 * 192    # 16 (batch, head) pairs.
  kernel = 3221225472
  matmul = 2 * 256 * 2048 * 1536
  assert flops == (loop + batched + kernel + matmul, matmul)


def test_a_grouped_matmul_counts_the_rows_its_groups_cover():
  """A megablox call's cost estimate counts all its M rows; its grid
  visits only the rows its groups cover, which its name scope states
  (`gmm.ROWS_SCOPE`): R of M rows count R/M of the estimate."""
  line = ('  ROOT %custom-call.1 = bf16[1024,512]{1,0} custom-call(%a, %b), '
          'custom_call_target="tpu_custom_call", backend_config={"custom_'
          'call_config":{"cost_estimate":{"flops":"4000"}}}, metadata='
          '{op_name="jit(update)/moe/' + gmm.ROWS_SCOPE.format(256, 1024) +
          '/pallas_call"}')
  hlo = ("HloModule m\n\nENTRY %main (a: bf16[1024,64], b: bf16[64,512]) "
         "-> bf16[1024,512] {\n  %a = bf16[1024,64]{1,0} parameter(0)\n"
         "  %b = bf16[64,512]{1,0} parameter(1)\n" + line + "\n}\n")
  assert hlo_flops.count(hlo).total == 1000
  assert hlo_flops.count(hlo.replace("gmm_rows_256", "xyz")).total == 4000
