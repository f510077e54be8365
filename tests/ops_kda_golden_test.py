"""Tests of the KDA op `chunk_kda` against FLA's golden fixture."""

import functools
import os

import kda_support
import numpy as np
import pytest

# Tiny shapes: compilation dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

ALL_IMPLS = kda_support.KDA_ALL_IMPLS
DIFF_FIELDS = kda_support.KDA_DIFF_FIELDS
TOKEN_FIELDS = kda_support.KDA_TOKEN_FIELDS
_Report = kda_support.ErrorReport
assert_same = kda_support.assert_same
fwd_and_grads = kda_support.kda_fwd_and_grads

# FLA's outputs and gradients for six KDA cases (tests/testdata/README.md).
GOLDEN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "testdata", "fla_kda_golden.npz")
GOLDEN_CASES = ("dense", "dense_h0", "varlen", "varlen_gate_l2",
                "varlen_lowerbound", "spikes")


# ----------------------------------------------------------------------------
# FLA golden fixture.


@functools.lru_cache(maxsize=None)
def _golden():
  if not os.path.exists(GOLDEN_PATH):
    raise FileNotFoundError(
        f"{GOLDEN_PATH} is missing: it ships with the repository "
        "(see tests/testdata/README.md).")
  with np.load(GOLDEN_PATH) as z:
    return {n: z[n] for n in z.files}


# Tolerances on rel_err vs the stored FLA values (README error table). FLA's
# own chunk_kda sits ~1e-6 from float64 for outputs, states and token grads,
# so 1e-5 leaves room for our float32 error. dA_log / ddt_bias are sums over
# all tokens with heavy cancellation: FLA's stored values are themselves up to
# 7e-5 / 1.7e-5 off float64 (README), hence 3e-4. In `spikes`, FLA's float32
# in-chunk gate cumsum loses precision after a -1000 entry (ulp(1000) ~ 6e-5):
# its stored chunk values are only ~3e-5 accurate, hence 1e-4 for that case.
GOLDEN_TOL = 1e-5
GOLDEN_TOL_SPIKES = 1e-4
GOLDEN_TOL_REDUCED = 3e-4


# The golden fixture also runs the Pallas kernels (interpret mode on CPU):
# the one place the FLA peer is checked for every implementation.
@pytest.mark.parametrize("impl", ALL_IMPLS + ["pallas"])
@pytest.mark.parametrize("case", GOLDEN_CASES)
def test_golden_fixture(case, impl):
  z = _golden()
  f = lambda name: z[f"{case}__{name}"]
  has = lambda name: f"{case}__{name}" in z
  params = {n: f(n) for n in TOKEN_FIELDS}
  for n in ("initial_state", "A_log", "dt_bias"):
    if has(n):
      params[n] = f(n)
  static = dict(use_gate_in_kernel=bool(f("use_gate_in_kernel")),
                use_qk_l2norm_in_kernel=bool(f("use_qk_l2norm_in_kernel")),
                safe_gate=bool(f("safe_gate")),
                chunk_size=int(f("chunk_size")))
  if has("lower_bound"):
    static["lower_bound"] = float(f("lower_bound"))
  if has("cu_seqlens"):
    static["cu_seqlens"] = tuple(int(c) for c in f("cu_seqlens"))
  # FLA ran with scale=None; check the convention and use our default too.
  np.testing.assert_allclose(f("scale"), f("q").shape[-1] ** -0.5, rtol=1e-6)

  o, s, grads = fwd_and_grads(impl, params, f("do"), f("dht"), **static)
  tol = GOLDEN_TOL_SPIKES if case == "spikes" else GOLDEN_TOL
  rep = _Report(f"golden {case} [{impl}]")
  rep.check("o vs chunk", o, f("o"), tol)
  rep.check("final_state vs chunk", s, f("final_state"), tol)
  rep.check("o vs naive", o, f("o_naive"), tol)
  rep.check("final_state vs naive", s, f("final_state_naive"), tol)
  for n in DIFF_FIELDS:
    if n in params:
      red = n in ("A_log", "dt_bias")
      rep.check(f"d{n}", grads[n], f(f"d{n}"), GOLDEN_TOL_REDUCED if red
                else tol)
  rep.done()


# The same golden documents as packed rows with `segment_ids`. FLA's varlen
# cases give each document its own row (`cu_seqlens`), so the resets inside a
# row are checked here: every document of a case is laid end to end in one
# row, adjacent documents separated only by a change of id (no padding), and
# every implementation must reproduce FLA's outputs and gradients.
#
# Only cases without an initial state keep this exact: a packed row has one
# `initial_state`, for its first segment, and every later segment starts from
# zero, whereas FLA gives each document its own (random) state. So "dense"
# (its two one-document rows, concatenated: a boundary inside a chunk) and
# "varlen_lowerbound" (1-token documents at t=0 and at a chunk's first row,
# a 125-token one crossing chunks) run; "dense_h0", "varlen", "varlen_gate_l2"
# and "spikes" carry initial states that only `cu_seqlens` (or one document
# per row) can feed.
#
# A row returns one final state, after its last document. To check every
# document's final state and the exact golden gradients, the batch holds N
# rows for N documents, all with the same tokens: row n keeps the ids of
# documents 0..n and marks the rest padding (0), so its final state is
# document n's. The output cotangent of row n is FLA's `do` on document n's
# tokens only, its final-state cotangent FLA's `dht[n]`; the loss is then
# FLA's loss summed over disjoint pieces, and the gradient of a shared input
# is the sum of the rows' gradients. Row N-1 is the whole packed row.
GOLDEN_PACKED_CASES = ("dense", "varlen_lowerbound")


def golden_packed_rows(case):
  """(params, static, segment_ids, do, dht, cu) of a golden case as rows."""
  z = _golden()
  f = lambda name: z[f"{case}__{name}"]
  assert f"{case}__initial_state" not in z, case
  if f"{case}__cu_seqlens" in z:
    cu = f("cu_seqlens").astype(np.int64)
  else:  # one document per row: the rows end to end
    b, t = f("q").shape[:2]
    cu = np.arange(b + 1) * t
  n_docs = len(cu) - 1
  flat = lambda x: x.reshape(1, -1, *x.shape[2:])
  params = {n: np.repeat(flat(f(n)), n_docs, axis=0) for n in TOKEN_FIELDS}
  for n in ("A_log", "dt_bias"):
    if f"{case}__{n}" in z:
      params[n] = f(n)
  static = dict(use_gate_in_kernel=bool(f("use_gate_in_kernel")),
                use_qk_l2norm_in_kernel=bool(f("use_qk_l2norm_in_kernel")),
                safe_gate=bool(f("safe_gate")),
                chunk_size=int(f("chunk_size")))
  if f"{case}__lower_bound" in z:
    static["lower_bound"] = float(f("lower_bound"))
  t = int(cu[-1])
  doc_of = np.repeat(np.arange(n_docs), np.diff(cu))         # [T]
  seg = np.where(doc_of[None, :] <= np.arange(n_docs)[:, None],
                 doc_of[None, :] + 1, 0).astype(np.int32)    # [N,T]
  do = np.where((doc_of[None, :] == np.arange(n_docs)[:, None])[..., None,
                                                                None],
                flat(f("do")), 0.0).astype(np.float32)
  assert seg.shape == (n_docs, t)
  return params, static, seg, do, f("dht"), cu


@pytest.mark.parametrize("impl", ALL_IMPLS + ["pallas"])
@pytest.mark.parametrize("case", GOLDEN_PACKED_CASES)
def test_golden_fixture_packed_in_one_row(case, impl):
  z = _golden()
  f = lambda name: z[f"{case}__{name}"]
  params, static, seg, do, dht, cu = golden_packed_rows(case)
  o, s, grads = fwd_and_grads(impl, params, do, dht, segment_ids=seg,
                              **static)
  flat = lambda x: x.reshape(1, -1, *x.shape[2:])[0]
  tol = GOLDEN_TOL
  rep = _Report(f"golden {case} packed in one row [{impl}]")
  rep.check("o, whole row", o[-1], flat(f("o")), tol)
  for n in range(len(cu) - 1):
    rep.check(f"o, row {n} [0,{cu[n + 1]})", o[n, :cu[n + 1]],
              flat(f("o"))[:cu[n + 1]], tol)
    rep.check(f"final_state doc {n}", s[n], f("final_state")[n], tol)
  for n in TOKEN_FIELDS:
    rep.check(f"d{n}", grads[n].sum(0), flat(f(f"d{n}")), tol)
  for n in ("A_log", "dt_bias"):
    if n in params:
      rep.check(f"d{n}", grads[n], f(f"d{n}"), GOLDEN_TOL_REDUCED)
  rep.done()
  # Row n's padding (documents after n) gives zero output.
  for n in range(len(cu) - 1):
    assert_same(o[n, cu[n + 1]:], np.zeros_like(o[n, cu[n + 1]:]),
                f"o at row {n}'s padding")
