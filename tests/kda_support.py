"""The KDA op tests' support (tests/ops_kda_*_test.py): shapes, inputs,
the error report and compiled forward+gradient calls.

Every implementation in `KDA_IMPLS_UNDER_TEST`, and the float32
"reference" itself, is checked against `testbed.kda_cases.kda_float64` and
FLA's golden fixture, and against the packing / causality / validation
contracts. A new implementation (e.g. "pallas") is tested by adding its
name to `KDA_IMPLS_UNDER_TEST`.

Compile budget. Compiling the chunked forward+backward costs seconds, so
the op tests share a few shapes (`KDA_B, KDA_H, KDA_K, KDA_V`,
`KDA_PACKED_T`) and one jitted forward+gradient function per (impl, static
config), cached for the whole process by `kda_fwd_and_grads`; checks that
need several calls reuse one compiled shape.

Two of its helpers serve other tests too: `assert_same` (bit-identity with
a useful message) and `random_segment_row` (a random segment-id row).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import process_support

from kda_lm.ops.kda import api
from testbed import kda_cases, numerics

KDA_IMPLS_UNDER_TEST = ["xla"]   # compared against "reference"
KDA_ALL_IMPLS = ["reference"] + KDA_IMPLS_UNDER_TEST

KDA_B, KDA_H, KDA_K, KDA_V = 2, 2, 32, 48   # K != V everywhere
# Packed rows: documents cross 64-token chunks.
KDA_PACKED_B, KDA_PACKED_T = 3, 150
KDA_DIFF_FIELDS = ("q", "k", "v", "g", "beta", "initial_state", "A_log",
                   "dt_bias")
KDA_TOKEN_FIELDS = ("q", "k", "v", "g", "beta")


class ErrorReport:
  """Collects named relative errors and fails once, listing all of them."""

  def __init__(self, title):
    self.title = title
    self.lines = []
    self.failures = []

  def check(self, name, got, want, tol):
    err = numerics.rel_err(got, want)
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
def _grad_fn(impl, frozen, compiler_options=None):
  """jit(grad) of loss = sum(o * do) + sum(final_state * dht); aux (o, S)."""
  kw = _kwargs(frozen)

  def loss(params, segment_ids, do, dht):
    o, s = api.chunk_kda(**params, segment_ids=segment_ids,
                         output_final_state=True, impl=impl, **kw)
    value = jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(s * dht)
    return value, (o, s)

  return jax.jit(jax.grad(loss, has_aux=True),
                 compiler_options=compiler_options)


def kda_fwd_and_grads(impl, params, do, dht, segment_ids=None, fresh=False,
                      **static):
  """Returns numpy (o, final_state, {name: grad}) from one compiled call;
  `fresh` compiles anew as a user's program is (under the current XLA
  optimization setting, XLA:CPU's default code generation), uncached."""
  if fresh:
    fn = _grad_fn.__wrapped__(impl, _freeze(static),
                              process_support.USER_CPU_CODEGEN)
  else:
    fn = _grad_fn(impl, _freeze(static))
  grads, (o, s) = fn(params, segment_ids, do, dht)
  return jax.tree.map(np.asarray, (o, s, grads))


@functools.lru_cache(maxsize=None)
def _fwd_fn(impl, frozen):
  kw = _kwargs(frozen)
  return jax.jit(lambda params, segment_ids: api.chunk_kda(
      **params, segment_ids=segment_ids, output_final_state=True, impl=impl,
      **kw))


def kda_fwd(impl, params, segment_ids=None, **static):
  """Returns numpy (o, final_state) from one compiled (cached) call."""
  o, s = _fwd_fn(impl, _freeze(static))(params, segment_ids)
  return np.asarray(o), np.asarray(s)


def kda_test_inputs(rng, b, t, **kwargs):
  """`kda_inputs` at the op tests' H, K, V: (params, static)."""
  return kda_cases.kda_inputs(rng, b, t, KDA_H, KDA_K, KDA_V, **kwargs)


def kda_test_cotangents(rng, o_shape, n_states):
  """`kda_cotangents` at the op tests' K."""
  return kda_cases.kda_cotangents(rng, o_shape, n_states, KDA_K)


def random_segment_row(rng, t, first_id=1):
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


def kda_packed_layout(seed):
  """[3, KDA_PACKED_T] ids: row 0 starts with padding, row 1 is one
  document."""
  rng = np.random.default_rng(1000 + seed)
  lead = int(rng.integers(1, 6))
  row0 = np.concatenate([np.zeros(lead, np.int32),
                         random_segment_row(rng, KDA_PACKED_T - lead, 3)])
  row1 = np.full(KDA_PACKED_T, 7, np.int32)
  row2 = random_segment_row(rng, KDA_PACKED_T, 1)
  return np.stack([row0, row1, row2])


KDA_PACKED_STATIC = dict(use_qk_l2norm_in_kernel=True)  # pre-activated gates


def kda_packed_inputs(seed):
  """(params, do, dht) for the packed rows of `kda_packed_layout`."""
  rng = np.random.default_rng(seed)
  params, static = kda_test_inputs(rng, KDA_PACKED_B, KDA_PACKED_T,
                                   gate="pre", l2norm=True)
  assert static == KDA_PACKED_STATIC
  do, dht = kda_test_cotangents(rng, params["v"].shape, KDA_PACKED_B)
  return params, do, dht
