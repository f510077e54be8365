"""Tests of the KDA op's segment resets: packing, cu_seqlens, reused ids."""

import jax
import kda_support
import numpy as np
import pytest

from kda_lm.ops import chunk_kda

# Tiny shapes: compilation dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")

ALL_IMPLS = kda_support.KDA_ALL_IMPLS
H, K, V = kda_support.KDA_H, kda_support.KDA_K, kda_support.KDA_V
TOKEN_FIELDS = kda_support.KDA_TOKEN_FIELDS
PACKED_B, PACKED_T = kda_support.KDA_PACKED_B, kda_support.KDA_PACKED_T
PACKED_STATIC = kda_support.KDA_PACKED_STATIC
_Report = kda_support.ErrorReport
assert_same = kda_support.assert_same
fwd_and_grads = kda_support.kda_fwd_and_grads
fwd = kda_support.kda_fwd
make_inputs = kda_support.kda_test_inputs
segments_of = kda_support.segments_of
packed_layout = kda_support.kda_packed_layout
packed_inputs = kda_support.kda_packed_inputs


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
# ----------------------------------------------------------------------------
# cu_seqlens, ids reused after padding, vmap over rows.


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
