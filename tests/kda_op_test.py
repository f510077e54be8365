"""Tests of the KDA op `kda_lm.ops.chunk_kda`.

Every implementation in `IMPLS_UNDER_TEST`, and the float32 `"reference"`
itself, is checked against the token-by-token recurrence run in float64
(`kda_lm.testing.kda_float64`), so each error is the implementation's own;
every implementation is also checked against FLA's golden fixture and the
packing / causality / validation contracts. A new implementation (e.g.
`"pallas"`) is tested by adding its name to `IMPLS_UNDER_TEST`.

Error metric: `kda_lm.testing.rel_err(a, b) = ||a - b||_2 / ||b||_2` over
the whole array, in float64: the fixture README's "relative RMS", so one
metric serves the float32, bfloat16 and golden checks. Inputs:
`kda_lm.testing.kda_inputs` (FLA's test distributions).

Compile budget. Compiling the chunked forward+backward costs seconds, so all
tests share a few shapes (`B, H, K, V` below, `PACKED_T`) and one jitted
forward+gradient function per (impl, static config), cached in
`_grad_fn`; checks that need several calls reuse one compiled shape.
"""

import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kda_lm import testing
from kda_lm.ops import chunk_kda
from kda_lm.ops.kda import api

# Tiny shapes: compilation dominates (conftest.fast_compile); two cases of
# `test_optimised_compile_matches_reference` compile with every
# optimization, as users run the op.
pytestmark = pytest.mark.usefixtures("fast_compile")

IMPLS_UNDER_TEST = ["xla"]   # compared against "reference"
ALL_IMPLS = ["reference"] + IMPLS_UNDER_TEST

B, H, K, V = 2, 2, 32, 48    # K != V everywhere
PACKED_B, PACKED_T = 3, 150  # packed rows: documents cross 64-token chunks
DIFF_FIELDS = ("q", "k", "v", "g", "beta", "initial_state", "A_log",
               "dt_bias")
TOKEN_FIELDS = ("q", "k", "v", "g", "beta")
GATE_FIELDS = ("g", "A_log", "dt_bias")
BF16 = ml_dtypes.bfloat16

# FLA's outputs and gradients for six KDA cases (tests/testdata/README.md).
GOLDEN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "testdata", "fla_kda_golden.npz")
GOLDEN_CASES = ("dense", "dense_h0", "varlen", "varlen_gate_l2",
                "varlen_lowerbound", "spikes")


# ----------------------------------------------------------------------------
# Helpers.


rel_err = testing.rel_err


class _Report:
  """Collects named relative errors and fails once, listing all of them."""

  def __init__(self, title):
    self.title = title
    self.lines = []
    self.failures = []

  def check(self, name, got, want, tol):
    err = rel_err(got, want)
    line = f"{name:<28} rel_err={err:.2e} (tol {tol:.0e})"
    self.lines.append(line)
    if not err <= tol:
      self.failures.append(line)

  def done(self):
    print(f"\n{self.title}\n  " + "\n  ".join(self.lines))
    assert not self.failures, (f"{self.title}: over tolerance:\n  "
                               + "\n  ".join(self.failures))


def assert_same(got, want, what):
  """Bit-identity (np.array_equal), with a useful message when it fails."""
  got, want = np.asarray(got), np.asarray(want)
  if not np.array_equal(got, want):
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    raise AssertionError(
        f"{what}: not bit-identical: {int(np.sum(got != want))} of "
        f"{got.size} entries differ, max |diff| = {np.nanmax(diff):.3e}")


def _freeze(static):
  return tuple(sorted(static.items()))


def _kwargs(frozen):
  kw = dict(frozen)
  if kw.get("cu_seqlens") is not None:
    kw["cu_seqlens"] = np.asarray(kw["cu_seqlens"], np.int32)
  return kw


@functools.lru_cache(maxsize=None)
def _grad_fn(impl, frozen):
  """jit(grad) of loss = sum(o * do) + sum(final_state * dht); aux (o, S)."""
  kw = _kwargs(frozen)

  def loss(params, segment_ids, do, dht):
    o, s = chunk_kda(**params, segment_ids=segment_ids,
                     output_final_state=True, impl=impl, **kw)
    value = jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(s * dht)
    return value, (o, s)

  return jax.jit(jax.grad(loss, has_aux=True))


def fwd_and_grads(impl, params, do, dht, segment_ids=None, fresh=False,
                  **static):
  """Returns numpy (o, final_state, {name: grad}) from one compiled call;
  `fresh` compiles anew (under the current XLA settings), uncached."""
  make = _grad_fn.__wrapped__ if fresh else _grad_fn
  grads, (o, s) = make(impl, _freeze(static))(params, segment_ids, do, dht)
  return jax.tree.map(np.asarray, (o, s, grads))


@functools.lru_cache(maxsize=None)
def _fwd_fn(impl, frozen):
  kw = _kwargs(frozen)
  return jax.jit(lambda params, segment_ids: chunk_kda(
      **params, segment_ids=segment_ids, output_final_state=True, impl=impl,
      **kw))


def fwd(impl, params, segment_ids=None, **static):
  o, s = _fwd_fn(impl, _freeze(static))(params, segment_ids)
  return np.asarray(o), np.asarray(s)


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _logsigmoid(x):
  return -np.logaddexp(0.0, -x)


def make_inputs(rng, b, t, **kwargs):
  """`testing.kda_inputs` at this module's H, K, V: (params, static)."""
  return testing.kda_inputs(rng, b, t, H, K, V, **kwargs)


def make_cotangents(rng, o_shape, n_states):
  return testing.kda_cotangents(rng, o_shape, n_states, K)


def random_row(rng, t, first_id=1):
  """A random segment-id row: documents of 1..99 tokens, padding runs (one
  always in mid-row), ids that skip values, ids reused after padding."""
  ids, nxt, last = [], first_id, None
  gap_at = int(rng.integers(t // 3, 2 * t // 3 + 1))
  while len(ids) < t:
    u = rng.random()
    if u < 0.2 or len(ids) == gap_at:
      ids += [0] * int(rng.integers(1, 9))
      continue
    if last is not None and ids[-1] == 0 and u < 0.35:
      doc = last                                         # reuse after padding
    else:
      doc, nxt = nxt, nxt + int(rng.integers(1, 3))
    n = 1 if u < 0.45 else int(rng.integers(2, 100))
    if len(ids) < gap_at:
      n = min(n, gap_at - len(ids))                      # stop at the gap
    ids += [doc] * n
    last = doc
  return np.asarray(ids[:t], np.int32)


def segments_of(row):
  """Maximal runs of one non-zero id: the RFC-0026 segments, as (start, end)."""
  out, start = [], None
  for t, s in enumerate(list(row) + [0]):
    if start is not None and s != row[start]:
      out.append((start, t))
      start = None
    if start is None and s != 0:
      start = t
  return out


def packed_layout(seed):
  """[3, PACKED_T] ids: row 0 starts with padding, row 1 is one document."""
  rng = np.random.default_rng(1000 + seed)
  lead = int(rng.integers(1, 6))
  row0 = np.concatenate([np.zeros(lead, np.int32),
                         random_row(rng, PACKED_T - lead, 3)])
  row1 = np.full(PACKED_T, 7, np.int32)
  row2 = random_row(rng, PACKED_T, 1)
  return np.stack([row0, row1, row2])


PACKED_STATIC = dict(use_qk_l2norm_in_kernel=True)  # pre-activated gates


def packed_inputs(seed):
  rng = np.random.default_rng(seed)
  params, static = make_inputs(rng, PACKED_B, PACKED_T, gate="pre",
                               l2norm=True)
  assert static == PACKED_STATIC
  do, dht = make_cotangents(rng, params["v"].shape, PACKED_B)
  return params, do, dht


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


# ----------------------------------------------------------------------------
# Implementations (and the float32 reference) vs the float64 recurrence.

# A covering set instead of the cross product: every value of every factor
# (T in {1, 63, 64, 65, 200}; gate pre-activated / softplus / lower_bound=-5
# with safe_gate; l2norm on/off; initial_state on/off; float32 / bfloat16
# inputs; -1000 gate spikes; segment_ids with padding) appears at least once.
# name: (T, gate, l2norm, h0, dtype, spikes, segments)
CASES = {
    "t1_pre": (1, "pre", False, True, "f32", False, False),
    "t63_softplus_l2": (63, "softplus", True, False, "f32", False, False),
    "t64_safe_l2_h0_bf16": (64, "safe", True, True, "bf16", False, False),
    "t65_pre_l2_spikes": (65, "pre", True, False, "f32", True, False),
    "t200_softplus_h0_segs": (200, "softplus", False, True, "f32", False,
                              True),
    "t200_safe": (200, "safe", False, False, "f32", False, False),
    "t65_softplus_l2_h0_bf16_segs": (65, "softplus", True, True, "bf16",
                                     False, True),
    "t200_pre_h0_spikes_segs": (200, "pre", False, True, "f32", True, True),
    "t63_pre_l2_h0_bf16": (63, "pre", True, True, "bf16", False, False),
}

# float32: rel_err <= 1e-5 (1e-4 with -1000 spikes: one token's gates then
# differ by 1000 between rows, and decays such as exp(G_r - G_s) are formed
# from float32 numbers of that magnitude). The closest call, measured on
# t200_safe: dA_log (a sum over every token and channel of a head) at
# 8.2e-6 for "xla", where the float32 reference itself is at 3.2e-6.
F32_TOL, F32_TOL_SPIKES = 1e-5, 1e-4
# bfloat16 inputs (FLA's metric = rel_err): o and states 5e-3, gate grads
# (g, A_log, dt_bias) 2e-2; q/k/v/beta/h0 grads are held to 5e-3 as well.
BF16_TOL, BF16_TOL_GATE = 5e-3, 2e-2


def case_inputs(name):
  """(params_f32, params_for_impl, static, segment_ids, do, dht) of a case.

  For bfloat16 cases the token inputs are rounded to bfloat16; the reference
  then runs on the same rounded values in float32, as FLA's tests do.
  """
  t, gate, l2norm, h0, dtype, spikes, segs = CASES[name]
  rng = np.random.default_rng(list(CASES).index(name))
  params, static = make_inputs(rng, B, t, gate=gate, l2norm=l2norm, h0=h0,
                               spikes=spikes)
  do, dht = make_cotangents(rng, params["v"].shape, B)
  seg = None
  if segs:
    seg = np.stack([random_row(rng, t, 1) for _ in range(B)])
    assert (seg == 0).any() and any(len(segments_of(r)) > 1 for r in seg)
  low = dict(params)
  if dtype == "bf16":
    for n in TOKEN_FIELDS:
      low[n] = params[n].astype(BF16)
      params[n] = low[n].astype(np.float32)
  return params, low, static, seg, do, dht


@functools.lru_cache(maxsize=None)
def _float64_result(name):
  """The float64 recurrence on the case's (rounded, for bfloat16) inputs."""
  params, _, static, seg, do, dht = case_inputs(name)
  return testing.kda_float64(params, do, dht, seg, **static)


@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, impl):
  _check_matches_reference(name, impl)


# Every XLA optimization inside (this module skips most); use with
# `fresh=True`, since jit's cache ignores the setting.
_fully_optimised = functools.partial(testing.most_optimizations_disabled,
                                     False)


@pytest.mark.parametrize("name", ["t200_softplus_h0_segs", "t200_safe"])
def test_optimised_compile_matches_reference(name):
  with _fully_optimised():
    _check_matches_reference(name, "xla", fresh=True)


def _check_matches_reference(name, impl, fresh=False):
  """Output, final state and every gradient of `impl` on case `name`
  against the float64 recurrence, at the case's tolerances."""
  _, low, static, seg, do, dht = case_inputs(name)
  o_ref, s_ref, g_ref = _float64_result(name)
  o, s, grads = fwd_and_grads(impl, low, do, dht, segment_ids=seg,
                              fresh=fresh, **static)
  assert o.dtype == low["q"].dtype and s.dtype == np.float32
  bf16 = CASES[name][4] == "bf16"
  spikes = CASES[name][5]
  tol = BF16_TOL if bf16 else F32_TOL_SPIKES if spikes else F32_TOL
  gate_tol = BF16_TOL_GATE if bf16 else tol
  rep = _Report(f"{name} [{impl} vs float64 recurrence]")
  rep.check("o", o, o_ref, tol)
  rep.check("final_state", s, s_ref, tol)
  for n in DIFF_FIELDS:
    if n in low:
      assert grads[n].dtype == low[n].dtype, n
      tol_n = gate_tol if n in GATE_FIELDS else tol
      rep.check(f"d{n}", grads[n], g_ref[n], tol_n)
  rep.done()


# ----------------------------------------------------------------------------
# Packing: packed == unpacked, isolation, padding.

PACKED_SEEDS = (0, 1)


def _alone(params, b, start, end, first):
  """The tokens [start, end) of row b alone: B=1, no segment_ids.

  Every alone run uses one shape ([1, PACKED_T]) so it compiles once: the
  document sits at t=0 and is followed by all-zero tokens, which are exactly
  transparent (g=0 decays by exp(0)=1, k=0 writes nothing; l2norm(0)=0), so
  the final state is the state after the document's last token. The first
  segment of a row starts from the row's initial_state, later ones from zero.
  """
  alone = {}
  for n in TOKEN_FIELDS:
    x = np.zeros((1, PACKED_T) + params[n].shape[2:], np.float32)
    x[0, :end - start] = params[n][b, start:end]
    alone[n] = x
  h0 = params["initial_state"][b:b + 1]
  alone["initial_state"] = h0 if first else np.zeros_like(h0)
  return alone


@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize("seed", PACKED_SEEDS)
def test_packed_equals_unpacked(seed, impl):
  seg = packed_layout(seed)
  params, do, dht = packed_inputs(seed)
  # The layout has what the test is about.
  rows = [segments_of(r) for r in seg]
  lens = [e - s for r in rows for s, e in r]
  assert seg[0, 0] == 0 and rows[1] == [(0, PACKED_T)]
  assert 1 in lens, "no 1-token document"
  assert any(s // 64 != (e - 1) // 64 for r in rows for s, e in r)
  assert any(r[i][1] < r[i + 1][0] for r in rows for i in range(len(r) - 1))
  assert any(seg[b, r[i][0]] == seg[b, r[i + 1][0]]
             for b, r in enumerate(rows) for i in range(len(r) - 1)), (
                 "no id reused after padding")

  o, s, grads = fwd_and_grads(impl, params, do, dht, segment_ids=seg,
                              **PACKED_STATIC)
  rep = _Report(f"packed seed={seed} [{impl}]")
  for b, row in enumerate(rows):
    for i, (start, end) in enumerate(row):
      o1, s1 = fwd(impl, _alone(params, b, start, end, i == 0),
                   **PACKED_STATIC)
      rep.check(f"o row{b} [{start},{end})", o[b, start:end],
                o1[0, :end - start], 1e-5)
    rep.check(f"final_state row{b}", s[b], s1[0], 1e-5)
  rep.done()

  pad = seg == 0
  assert_same(o[pad], np.zeros_like(o[pad]), "o at padding")
  for n in TOKEN_FIELDS:
    assert_same(grads[n][pad], np.zeros_like(grads[n][pad]),
                f"d{n} at padding")
  for n, gr in grads.items():
    assert np.all(np.isfinite(gr)), f"d{n} not finite"


@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize("seed", PACKED_SEEDS)
def test_packed_isolation_bit_identical(seed, impl):
  """Changing one document, one row or padding changes nothing else."""
  seg = packed_layout(seed)
  params, do, dht = packed_inputs(seed)
  run = lambda p: fwd_and_grads(impl, p, do, dht, segment_ids=seg,
                                **PACKED_STATIC)[:2]
  o, s = run(params)
  rng = np.random.default_rng(99 + seed)
  rows = [segments_of(r) for r in seg]

  def changed(where):
    """params with fresh random q, k, v, g, beta where `where` [B,T]."""
    p = {n: a.copy() for n, a in params.items()}
    new = make_inputs(rng, PACKED_B, PACKED_T, gate="pre", l2norm=True,
                      h0=False)[0]
    for n in TOKEN_FIELDS:
      p[n][where] = new[n][where]
    return p

  # One document at a time: the longest of row 0, a 1-token one, row 2's
  # first and last.
  docs = [(0, max(rows[0], key=lambda r: r[1] - r[0]))]
  docs += [(b, r) for b, row in enumerate(rows) for r in row
           if r[1] - r[0] == 1][:1]
  docs += [(2, rows[2][0]), (2, rows[2][-1])]
  for b, (start, end) in docs:
    where = np.zeros(seg.shape, bool)
    where[b, start:end] = True
    o2, s2 = run(changed(where))
    assert not np.array_equal(o2[where], o[where])    # it did change
    assert_same(o2[~where], o[~where],
                f"o outside document row{b} [{start},{end})")
    keep = [r for r in range(PACKED_B) if r != b or (start, end) != rows[b][-1]]
    assert_same(s2[keep], s[keep], f"final states when changing row{b} "
                f"[{start},{end})")

  # One whole row, including its initial state.
  where = np.zeros(seg.shape, bool)
  where[1] = True
  p = changed(where)
  p["initial_state"][1] += 1.0
  o2, s2 = run(p)
  assert_same(o2[[0, 2]], o[[0, 2]], "o of rows 0, 2 when changing row 1")
  assert_same(s2[[0, 2]], s[[0, 2]], "states of rows 0, 2 when changing row 1")

  # Padding tokens' inputs (garbage there already) change nothing at all.
  o2, s2 = run(changed(seg == 0))
  assert_same(o2, o, "o when changing padding inputs")
  assert_same(s2, s, "final states when changing padding inputs")


# ----------------------------------------------------------------------------
# Causality.

CAUSAL_CONFIGS = {
    # Packed rows (segment resets, padding, exact gate path), three chunks.
    "packed": lambda: (packed_inputs(0)[0], PACKED_STATIC, packed_layout(0),
                       (1, 37, 64, 100, 149)),
    # No segments, bounded gates with safe_gate (the all-matmul path).
    "safe_gate": lambda: case_inputs("t200_safe")[1:4] + ((1, 17, 64, 150),),
}


@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize("config", list(CAUSAL_CONFIGS))
def test_causality(config, impl):
  params, static, seg, cuts = CAUSAL_CONFIGS[config]()
  b, t = params["q"].shape[:2]
  rng = np.random.default_rng(7)
  do_full, _ = make_cotangents(rng, params["v"].shape, b)
  dht = np.zeros((b, H, K, V), np.float32)
  for cut in cuts:
    do = do_full.copy()
    do[:, cut:] = 0.0                         # loss on outputs before `cut`
    o, _, grads = fwd_and_grads(impl, params, do, dht, segment_ids=seg,
                                **static)
    p = dict(params)
    for n in TOKEN_FIELDS:
      x = params[n].copy()
      noise = rng.standard_normal(x[:, cut:].shape).astype(np.float32)
      x[:, cut:] = (_sigmoid(noise) if n == "beta" else
                    _logsigmoid(noise) if n == "g" and "A_log" not in params
                    else noise)
      p[n] = x
    seg2 = None
    if seg is not None:
      seg2 = seg.copy()
      seg2[:, cut:] = rng.integers(0, 3, seg2[:, cut:].shape)
    o2, _, grads2 = fwd_and_grads(impl, p, do, dht, segment_ids=seg2,
                                  **static)
    assert not np.array_equal(o2[:, cut:], o[:, cut:])
    assert_same(o2[:, :cut], o[:, :cut], f"o before P={cut}")
    for n in TOKEN_FIELDS:
      assert_same(grads2[n][:, :cut], grads[n][:, :cut],
                  f"d{n} before P={cut}")


# ----------------------------------------------------------------------------
# Other contracts.


@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_segment_ids_none_equals_all_ones(impl):
  """Bit for bit in the optimised programs users run (without XLA's
  optimizations, the two programs may round differently by an ulp)."""
  _, low, static, seg, do, dht = case_inputs("t200_safe")
  assert seg is None
  ones = np.ones(low["q"].shape[:2], np.int32)
  with _fully_optimised():
    o, s, grads = fwd_and_grads(impl, low, do, dht, fresh=True, **static)
    o1, s1, grads1 = fwd_and_grads(impl, low, do, dht, segment_ids=ones,
                                   fresh=True, **static)
  assert_same(o1, o, "o")
  assert_same(s1, s, "final_state")
  for n in grads:
    assert_same(grads1[n], grads[n], f"d{n}")


def test_default_chunk_size_per_backend():
  """chunk_size=None runs the implementation's default chunk size."""
  assert api.default_chunk_size("pallas") == 64
  want = 32 if jax.default_backend() == "cpu" else 64
  assert api.default_chunk_size("xla") == want
  params, do, dht = packed_inputs(0)
  seg = packed_layout(0)
  o, s, _ = fwd_and_grads("xla", params, do, dht, segment_ids=seg,
                          **PACKED_STATIC)
  o2, s2, _ = fwd_and_grads("xla", params, do, dht, segment_ids=seg,
                            chunk_size=want, **PACKED_STATIC)
  assert_same(o2, o, "o")
  assert_same(s2, s, "final_state")


@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_cu_seqlens_equals_segment_ids(impl):
  """cu_seqlens (per-document states) == segment_ids, document by document.

  Row i of the segment_ids run holds document i alone (padding elsewhere) and
  starts from initial_state[i], so its final state is document i's state.
  """
  cu = (0, 1, 37, PACKED_T)        # a 1-token doc; one crossing 2 boundaries
  params, do, dht = packed_inputs(5)
  n_docs = len(cu) - 1
  assert n_docs == PACKED_B        # reuse the packed shapes
  one = {n: params[n][:1] for n in TOKEN_FIELDS}
  o_cu, s_cu = chunk_kda(**one, initial_state=params["initial_state"],
                         cu_seqlens=np.asarray(cu, np.int32),
                         output_final_state=True, impl=impl, **PACKED_STATIC)
  o_cu, s_cu = np.asarray(o_cu), np.asarray(s_cu)
  assert o_cu.shape == one["v"].shape and s_cu.shape == (n_docs, H, K, V)
  rows = {n: np.repeat(one[n], n_docs, axis=0) for n in TOKEN_FIELDS}
  rows["initial_state"] = params["initial_state"]
  seg = np.zeros((n_docs, PACKED_T), np.int32)
  for i in range(n_docs):
    seg[i, cu[i]:cu[i + 1]] = i + 1
  o, s, _ = fwd_and_grads(impl, rows, do, dht, segment_ids=seg,
                          **PACKED_STATIC)
  rep = _Report(f"cu_seqlens vs segment_ids [{impl}]")
  for i in range(n_docs):
    rep.check(f"o doc{i}", o_cu[0, cu[i]:cu[i + 1]], o[i, cu[i]:cu[i + 1]],
              1e-5)
    rep.check(f"final_state doc{i}", s_cu[i], s[i], 1e-5)
  rep.done()


@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_id_reused_after_padding_is_two_segments(impl):
  """(1,1,0,1) is two segments: identical to (1,1,0,2), and reset."""
  params, do, dht = packed_inputs(3)
  a, gap = 50, 20
  reused = np.array([[1] * a + [0] * gap + [1] * (PACKED_T - a - gap)] * 3,
                    np.int32)
  fresh = np.where(np.arange(PACKED_T) >= a + gap, 2, reused).astype(np.int32)
  o, s, _ = fwd_and_grads(impl, params, do, dht, segment_ids=reused,
                          **PACKED_STATIC)
  o2, s2, _ = fwd_and_grads(impl, params, do, dht, segment_ids=fresh,
                            **PACKED_STATIC)
  assert_same(o, o2, "o with (1,...,0,...,1) vs (1,...,0,...,2)")
  assert_same(s, s2, "final_state with reused vs fresh id")
  o1, s1 = fwd(impl, _alone(params, 0, a + gap, PACKED_T, False),
               **PACKED_STATIC)
  rep = _Report(f"reused id [{impl}]")
  rep.check("second segment o vs alone", o[0, a + gap:],
            o1[0, :PACKED_T - a - gap], 1e-5)
  rep.check("final_state vs alone", s[0], s1[0], 1e-5)
  rep.done()


@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_vmap_over_rows_equals_batch(impl):
  seg = packed_layout(0)
  params, do, dht = packed_inputs(0)
  o, s, _ = fwd_and_grads(impl, params, do, dht, segment_ids=seg,
                          **PACKED_STATIC)

  def one_row(p, ids):
    o1, s1 = chunk_kda(**{n: x[None] for n, x in p.items()},
                       segment_ids=ids[None], output_final_state=True,
                       impl=impl, **PACKED_STATIC)
    return o1[0], s1[0]

  ov, sv = jax.jit(jax.vmap(one_row))(params, seg)
  # Bit-identical today for both impls, but vmap builds a different XLA
  # program, so only a float32-rounding-level tolerance is promised.
  rep = _Report(f"vmap B=1 vs B=3 [{impl}]")
  rep.check("o", ov, o, 1e-6)
  rep.check("final_state", sv, s, 1e-6)
  rep.done()


def test_forward_mode_reference_and_clear_error():
  """jax.jvp works with the reference (its tangents are checked against a
  finite difference) and raises a clear TypeError with the chunked path,
  whose backward is a hand-derived custom VJP (reverse mode only)."""
  seg = packed_layout(1)
  params, _, _ = packed_inputs(1)
  rng = np.random.default_rng(7)
  tangents = {n: rng.standard_normal(x.shape).astype(np.float32)
              for n, x in params.items()}

  def run(which, p, t):
    f = lambda p: chunk_kda(**p, segment_ids=seg, output_final_state=True,
                            impl=which, **PACKED_STATIC)
    return jax.jit(lambda p, t: jax.jvp(f, (p,), (t,)))(p, t)

  (o, s), (do, ds) = run("reference", params, tangents)
  eps = 1e-3
  shift = lambda sign: {n: (x.astype(np.float64) + sign * eps * tangents[n]
                            ).astype(np.float32) for n, x in params.items()}
  (o_p, s_p), _ = run("reference", shift(1), tangents)
  (o_m, s_m), _ = run("reference", shift(-1), tangents)
  rep = _Report("jvp [reference vs central difference]")
  rep.check("tangent of o", do, (o_p - o_m) / (2 * eps), 1e-2)
  rep.check("tangent of final_state", ds, (s_p - s_m) / (2 * eps), 1e-2)
  rep.done()
  for impl in IMPLS_UNDER_TEST:
    with pytest.raises(TypeError, match=r"reverse-mode autodiff only.*"
                       r"impl='reference'"):
      run(impl, params, tangents)


# ----------------------------------------------------------------------------
# Bad input: ValueError with a useful message, before anything is traced.

_EVENTS = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: _EVENTS.append(event))


def _bad(changes):
  """Valid small arguments (B=2, T=8, H=2, K=4, V=6) with `changes`."""
  rng = np.random.default_rng(0)
  f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
  kw = dict(q=f32(2, 8, 2, 4), k=f32(2, 8, 2, 4), v=f32(2, 8, 2, 6),
            g=-np.abs(f32(2, 8, 2, 4)), beta=np.full((2, 8, 2), 0.5,
                                                    np.float32))
  one = lambda: {n: kw[n][:1] for n in TOKEN_FIELDS}  # B=1 for cu_seqlens
  kw.update(changes(kw, one, f32) if callable(changes) else changes)
  return kw


GATE = dict(use_gate_in_kernel=True, A_log=np.zeros(2, np.float32))
BAD_INPUTS = {
    "q_not_4d": (lambda kw, one, f: dict(q=kw["q"][0]), r"q must be"),
    "k_shape": (lambda kw, one, f: dict(k=kw["k"][:, :7]), r"k shape"),
    "g_shape": (lambda kw, one, f: dict(g=kw["g"][..., :3]), r"g shape"),
    "v_shape": (lambda kw, one, f: dict(v=kw["v"][:, :7]), r"v must be"),
    "beta_shape": (lambda kw, one, f: dict(beta=kw["beta"][..., None]),
                   r"beta must be"),
    "integer_q": (lambda kw, one, f: dict(q=kw["q"].astype(np.int32)),
                  r"q must be a floating"),
    "initial_state_shape": (lambda kw, one, f: dict(
        initial_state=f(2, 2, 6, 4)), r"initial_state must be"),
    "float_segment_ids": (lambda kw, one, f: dict(
        segment_ids=np.ones((2, 8), np.float32)), r"segment_ids.*integer"),
    "bool_segment_ids": (lambda kw, one, f: dict(
        segment_ids=np.ones((2, 8), bool)), r"segment_ids.*integer"),
    "segment_ids_shape": (lambda kw, one, f: dict(
        segment_ids=np.ones((2, 9), np.int32)), r"segment_ids must be"),
    "segment_ids_1d": (lambda kw, one, f: dict(
        segment_ids=np.ones((8,), np.int32)), r"segment_ids must be"),
    "negative_segment_ids": (lambda kw, one, f: dict(
        segment_ids=np.array([[1] * 7 + [-1]] * 2, np.int32)),
                             r"segment_ids must be >= 0"),
    "segment_ids_with_cu_seqlens": (lambda kw, one, f: dict(
        one(), segment_ids=np.ones((1, 8), np.int32),
        cu_seqlens=np.array([0, 8], np.int32)), r"not both"),
    "gate_without_A_log": (dict(use_gate_in_kernel=True),
                           r"use_gate_in_kernel=True requires A_log"),
    "A_log_shape": (dict(GATE, A_log=np.zeros(3, np.float32)),
                    r"A_log must be \[H\]"),
    "dt_bias_shape": (dict(GATE, dt_bias=np.zeros(4, np.float32)),
                      r"dt_bias must be \[H\*K\]"),
    "A_log_without_gate": (dict(A_log=np.zeros(2, np.float32)),
                           r"A_log is only used with use_gate_in_kernel"),
    "lower_bound_zero": (dict(GATE, lower_bound=0.0), r"lower_bound"),
    "lower_bound_below_-5": (dict(GATE, lower_bound=-5.5), r"lower_bound"),
    "lower_bound_positive": (dict(GATE, lower_bound=1.0), r"lower_bound"),
    "unknown_impl": (dict(impl="no_such_impl"), r"Unknown KDA impl"),
    "cu_seqlens_not_from_0": (lambda kw, one, f: dict(
        one(), cu_seqlens=np.array([1, 4, 8], np.int32)), r"cu_seqlens"),
    "cu_seqlens_not_to_T": (lambda kw, one, f: dict(
        one(), cu_seqlens=np.array([0, 4, 7], np.int32)), r"cu_seqlens"),
    "cu_seqlens_decreasing": (lambda kw, one, f: dict(
        one(), cu_seqlens=np.array([0, 5, 3, 8], np.int32)), r"cu_seqlens"),
    "cu_seqlens_float": (lambda kw, one, f: dict(
        one(), cu_seqlens=np.array([0.0, 4.0, 8.0], np.float32)),
                         r"cu_seqlens"),
    "cu_seqlens_2d": (lambda kw, one, f: dict(
        one(), cu_seqlens=np.array([[0, 4, 8]], np.int32)), r"cu_seqlens"),
    "cu_seqlens_with_B2": (lambda kw, one, f: dict(
        cu_seqlens=np.array([0, 4, 8], np.int32)), r"B == 1"),
    "cu_seqlens_initial_state_N": (lambda kw, one, f: dict(
        one(), cu_seqlens=np.array([0, 4, 8], np.int32),
        initial_state=f(1, 2, 4, 6)), r"initial_state must be"),
    "chunk_size_zero": (dict(chunk_size=0), r"chunk_size"),
    "chunk_size_negative": (dict(chunk_size=-64), r"chunk_size"),
    "chunk_size_float": (dict(chunk_size=64.0), r"chunk_size"),
    "chunk_size_not_multiple": (dict(chunk_size=100), r"chunk_size"),
    "safe_gate_without_lower_bound": (dict(GATE, safe_gate=True),
                                      r"safe_gate"),
    "safe_gate_without_gate_in_kernel": (dict(safe_gate=True), r"safe_gate"),
    "negative_scale": (dict(scale=-1.0), r"scale"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_before_tracing(name):
  changes, match = BAD_INPUTS[name]
  kw = _bad(changes)
  del _EVENTS[:]
  with pytest.raises(ValueError, match=match):
    chunk_kda(**kw)
  assert not _EVENTS, f"traced/compiled before raising: {set(_EVENTS)}"
  # The same call made while tracing a caller's jit raises the same error.
  with pytest.raises(ValueError, match=match):
    jax.jit(lambda: chunk_kda(**kw))()


def test_trace_listener_sees_compiles():
  """Guards the check above: the listener does see a fresh trace."""
  del _EVENTS[:]
  jax.jit(lambda x: x * 3 + 1)(np.zeros((3, 5, 7), np.float32))
  assert _EVENTS


# ----------------------------------------------------------------------------
# Degenerate inputs get clear errors.


def test_empty_time_axis_and_positive_gate_raise():
  rng = np.random.default_rng(0)

  def inputs(t, gate_sign):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    return dict(q=f(1, t, 1, 8), k=f(1, t, 1, 8), v=f(1, t, 1, 8),
                g=gate_sign * np.abs(f(1, t, 1, 8)),
                beta=np.full((1, t, 1), 0.5, np.float32))

  with pytest.raises(ValueError, match="T must be >= 1"):
    chunk_kda(**inputs(0, -1.0))
  bad = inputs(5, -1.0)
  bad["g"][0, 3, 0, 2] = 0.25
  with pytest.raises(ValueError, match=r"g\[0, 3, 0, 2\] = 0.25 > 0"):
    chunk_kda(**bad)
