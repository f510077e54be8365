"""In-kernel building blocks shared by every Pallas KDA kernel.

2-D ops only and no slicing of values (Triton has no slice lowering: rows
and columns are extracted by masked reductions, sub-blocks are loaded from
refs), plus the two drivers that run a recurrence step over the chunks.
"""

import contextlib

from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from kda_lm.ops.kda import common

CHUNK = 64                 # C: tokens per chunk
SUB = common.SUB_BLOCK     # c: rows per sub-block
NB = CHUNK // SUB          # sub-blocks per chunk
MAX_HEAD_DIM = 256         # K and V limit (state [K,V] f32 stays on chip)
F32 = jnp.float32
NEG_INF = -float("inf")

# The precision of every in-kernel dot, set while the kernels are traced
# (`dot_precision`): "highest" (IEEE float32), "tf32" (the backend's fast
# float32) or "bf16" (bfloat16 operands, float32 accumulation).
_precision = ["highest"]


@contextlib.contextmanager
def dot_precision(name):
  """Traces the kernels inside with `KernelOptions.precision` `name`."""
  previous = _precision[0]
  _precision[0] = name
  try:
    yield
  finally:
    _precision[0] = previous


def _dot(a, b, dims):
  mode = _precision[0]
  if mode == "bf16":
    a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
  precision = (lax.Precision.HIGHEST if mode == "highest"
               else lax.Precision.DEFAULT)
  return lax.dot_general(a, b, (dims, ((), ())),
                         precision=(precision, precision),
                         preferred_element_type=F32)


def mm(a, b):
  """a @ b in float32."""
  return _dot(a, b, ((1,), (0,)))


def mm_exact(mask, b):
  """mask @ b to float32 accuracy for a 0/1 `mask`, whatever the kernels'
  dot precision: b is split into three bfloat16-exact parts (8 mantissa
  bits each), each multiplied exactly by the 0/1 mask and accumulated in
  float32 (the split float32 tensor-core products use; an IEEE float32 dot
  costs Triton far more registers)."""
  if _precision[0] == "highest":
    return mm(mask, b)
  parts = []
  rest = b
  for _ in range(2):
    part = rest.astype(jnp.bfloat16).astype(F32)
    parts.append(part)
    rest = rest - part
  parts.append(rest)
  out = mm(mask, parts[0])
  for part in parts[1:]:
    out = out + mm(mask, part)
  return out


def mm_nt(a, b):
  """a @ b.T in float32."""
  return _dot(a, b, ((1,), (1,)))


def mm_tn(a, b):
  """a.T @ b in float32."""
  return _dot(a, b, ((0,), (0,)))


def rows(n):
  return lax.broadcasted_iota(jnp.int32, (n, 1), 0)


def cols(n):
  return lax.broadcasted_iota(jnp.int32, (1, n), 1)


def row(x, i):
  """Row i of x [n,m] as [1,m] (a masked sum: exact)."""
  return jnp.sum(jnp.where(rows(x.shape[0]) == i, x, 0.0), axis=0,
                 keepdims=True)


def col(x, j):
  """Column j of x [n,m] as [n,1]."""
  return jnp.sum(jnp.where(cols(x.shape[1]) == j, x, 0.0), axis=1,
                 keepdims=True)


def col_to_row(x):
  """[n,1] -> [1,n] without a transpose."""
  n = x.shape[0]
  return jnp.sum(jnp.where(rows(n) == cols(n), x, 0.0), axis=0,
                 keepdims=True)


def row_to_col(x):
  """[1,n] -> [n,1] without a transpose."""
  n = x.shape[1]
  return jnp.sum(jnp.where(rows(n) == cols(n), x, 0.0), axis=1,
                 keepdims=True)


def masked_exp(mask, x):
  """exp(x) where mask, else 0; the exponent is masked, never the result."""
  return jnp.exp(jnp.where(mask, x, NEG_INF))


def ref_blocks(ref, scale=None):
  """The NB sub-blocks [SUB, X] of a [CHUNK, X] ref."""
  out = []
  for i in range(NB):
    x = ref[pl.ds(i * SUB, SUB), :]
    out.append(x if scale is None else x * scale)
  return out


def pair_block(ref, i, j):
  """Sub-block (i, j) [SUB,SUB] of a [CHUNK, CHUNK] ref."""
  return ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)]


def store_square(ref, blocks):
  """Writes {(i, j), j <= i} [SUB,SUB] blocks into a [CHUNK, CHUNK] ref
  (zeros above the diagonal blocks)."""
  zero = jnp.zeros((SUB, SUB), F32)
  for i in range(NB):
    for j in range(NB):
      ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = (
          blocks[i, j] if j <= i else zero)


def store_pairs(ref, blocks):
  """Writes {(i, j), j <= i} blocks into a [NB*NB, SUB, SUB] ref (zeros
  above the diagonal)."""
  zero = jnp.zeros((SUB, SUB), F32)
  for i in range(NB):
    for j in range(NB):
      ref[i * NB + j] = blocks[i, j] if j <= i else zero


def store_blocks(ref, blocks):
  for i, x in enumerate(blocks):
    ref[pl.ds(i * SUB, SUB), :] = x



# The two recurrences are written once as a per-chunk step on a view of
# chunk c's data and run two ways: `loop_kernel` (GPU, and interpret mode by
# default) holds whole rows and loops over the chunks inside one program per
# V block; `grid_kernel` (TPU) gets one chunk per step of an "arbitrary"
# grid axis and carries the state in a VMEM scratch buffer, so its on-chip
# memory does not grow with T (Triton has no sequential grid axis).


class _RowsView:
  """Chunk c of whole-row refs: rows [c*C, (c+1)*C) or entry c."""

  def __init__(self, refs, kinds, c):
    self.refs, self.kinds = refs, kinds
    self.rows = pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)
    self.c = c

  def _index(self, name):
    return ((self.rows, slice(None)) if self.kinds[name].startswith("tok")
            else self.c)

  def get(self, name):
    return self.refs[name][self._index(name)]

  def set(self, name, value):
    self.refs[name][self._index(name)] = value


class _BlockView:
  """Refs that already hold just chunk c's block."""

  def __init__(self, refs):
    self.refs = refs

  def get(self, name):
    return self.refs[name][...]

  def set(self, name, value):
    self.refs[name][...] = value


def loop_kernel(*refs, names, kinds, step, init, final, n_chunks, reverse):
  """One V block: `step` over the chunks, the state as the loop value."""
  refs = dict(zip(names, refs, strict=True))

  def body(t, S):
    c = n_chunks - 1 - t if reverse else t
    return step(_RowsView(refs, kinds, c), S)

  refs[final][...] = lax.fori_loop(0, n_chunks, body,
                                   refs[init][...].astype(F32))


def grid_kernel(*refs, names, step, init, final, n_chunks):
  """One chunk per step of grid axis 2, the state in `scratch`."""
  *refs, scratch = refs
  refs = dict(zip(names, refs, strict=True))
  n = pl.program_id(2)

  @pl.when(n == 0)
  def _():
    scratch[...] = refs[init][...].astype(F32)

  S = step(_BlockView(refs), scratch[...])
  scratch[...] = S

  @pl.when(n == n_chunks - 1)
  def _():
    refs[final][...] = S
