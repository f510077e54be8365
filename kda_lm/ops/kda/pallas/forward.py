"""The forward kernels: per-chunk setup, the state recurrence step, output."""


from kda_lm.ops.kda.pallas import chunk
from kda_lm.ops.kda.pallas import helpers as hp


def intra_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, run_ref, reset_ref,
                 w_ref, u_ref, qf_ref, ke_ref, kf_ref, dv_ref, aqk_ref,
                 akk_ref, p_ref, *, scale):
  """Forward, chunk n: everything that does not depend on the state (and,
  for the backward, k F, Akk and P)."""
  ch = chunk.solve(chunk.chunk_from_refs(
      (q_ref, k_ref, v_ref, g_ref, beta_ref, run_ref, reset_ref), scale))
  hp.store_blocks(w_ref, ch.w)
  hp.store_blocks(u_ref, ch.u)
  hp.store_blocks(qf_ref, [ch.q[i] * ch.F[i] for i in range(hp.NB)])
  hp.store_blocks(ke_ref, [ch.k[i] * ch.E[i] for i in range(hp.NB)])
  hp.store_blocks(kf_ref, [ch.k[i] * ch.F[i] for i in range(hp.NB)])
  dv_ref[...] = ch.Dv
  hp.store_pairs(aqk_ref, ch.aqk)
  hp.store_square(akk_ref, ch.akk)
  hp.store_square(p_ref, ch.P)



def recur_step(x, S):
  """Forward: S entering chunk c -> S leaving it; writes v_new and S."""
  x.set("s_in", S)
  vn = x.get("u") - hp.mm(x.get("w"), S)
  x.set("vn", vn)
  return hp.row_to_col(x.get("dv")) * S + hp.mm_tn(x.get("ke"), vn)


def out_kernel(qf_ref, sin_ref, aqk_ref, vn_ref, o_ref):
  """Forward, chunk n: o = (q F) S + Aqk v_new."""
  S = sin_ref[...]
  vn = hp.ref_blocks(vn_ref)
  qf = hp.ref_blocks(qf_ref)
  o = []
  for i in range(hp.NB):
    o_i = hp.mm(qf[i], S)
    for j in range(i + 1):
      o_i = o_i + hp.mm(aqk_ref[i * hp.NB + j], vn[j])
    o.append(o_i)
  hp.store_blocks(o_ref, o)

