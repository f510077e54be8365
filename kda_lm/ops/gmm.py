r"""Grouped matmul: rows in contiguous groups, each times its own matrix.

Shape glossary: M rows (token, expert) pairs sorted by expert, K input
width, N output width, G groups (experts), `tm` rows per tile.

  gmm(lhs [M,K], rhs [G,K,N], group_sizes [G]) -> out [M,N]
  out[r] = lhs[r] @ rhs[g]  for r in [start_g, start_g + group_sizes[g])
  out[r] = 0                for r >= sum(group_sizes)

This is `jax.lax.ragged_dot`'s contract, but compiled to the work the
groups hold: `ragged_dot` lowers to a matmul over every group for every row
on CPU and GPU (and its TPU gradient likewise), G times the useful FLOPs
and a `[G,M,...]`-sized temporary. Implementations (`impl`):

* "megablox": JAX's Pallas TPU kernels (`gmm` for the output and the
  input gradient, `tgmm` for the weight gradient) in a custom VJP that
  also zeroes the rows past the groups, which the kernel leaves
  unwritten; interpret mode on CPU.
* "xla": the portable path. The rows are cut into tiles of `tm`; a work
  item is one (tile, group) pair whose rows overlap, at most
  `M/tm + G - 1` of them (fewer when rows lie past the groups: the loop
  stops at the last real item; its name scope, `MAX_TRIPS_SCOPE`, carries
  that bound into the compiled program). A `fori_loop` over the items
  multiplies each tile, masked to its group's rows, by its group's matrix,
  so FLOPs are `2*tm*K*N` per item (the useful work plus at most G - 1
  partial tiles; `default_tile_m` keeps them under M/4 rows) and memory is
  that of the inputs and outputs. The VJP is the same loop:
  `dlhs = gmm(dout, rhs^T)` and `drhs[g] += lhs_tile^T dout_tile`.
* "ragged_dot": `jax.lax.ragged_dot` itself, the reference in tests and
  benchmarks.
* "auto": on TPU megablox, or ragged_dot for at most
  `RAGGED_DOT_MAX_GROUPS` groups (the MoE layer counts all its experts,
  not a device's share); xla elsewhere.

Every call with rows sharded over devices must run inside `jax.shard_map`
(the MoE layer does): a Pallas call cannot be partitioned by GSPMD.
"""

import functools
import importlib
import re
from typing import Optional

import jax
import jax.numpy as jnp

IMPLS = ("auto", "xla", "megablox", "ragged_dot")
DEFAULT_TILE_M = 128
# The megablox kernels' rows per tile: on a TPU v5e, 512 rows gave the
# fastest forward+gradient at a MoE's shapes (32768 rows, 16 experts;
# `experiments/bench_gmm_tiles.py`, docs/performance.md), 128 the slowest.
MEGABLOX_TILE_M = 512
# "auto" on a TPU up to this many groups (a MoE layer's experts): on a v5e,
# `ragged_dot`'s forward+gradient at 8 groups took 0.98-1.05x the megablox
# kernels' time at a MoE's widths (32768 rows, 1536 <-> 512 and 1024) and
# 0.92x at ling3_tiny's, and ling3_tiny's update step compiled in 13-15 s
# against 19-21 s (docs/performance.md); at 16 groups it was up to 1.14x
# slower. Its gradient's work is dense over the groups: a 128-expert layer
# split 8 per device over expert=16 compiled (deviceless, v5p) to 4.16x
# the step's analytic FLOPs, so a layer's whole expert count decides.
RAGGED_DOT_MAX_GROUPS = 8


def resolve_impl(impl: str, num_groups: int) -> str:
  """`impl` as a concrete implementation (see the module docstring) for
  `num_groups` groups (the MoE layer passes all its experts).

  Raises:
    ValueError: unknown `impl`.
  """
  if impl not in IMPLS:
    raise ValueError(f"Unknown grouped-matmul impl {impl!r}; expected one "
                     f"of {IMPLS}.")
  if impl != "auto":
    return impl
  if jax.default_backend() != "tpu":
    return "xla"
  return "ragged_dot" if num_groups <= RAGGED_DOT_MAX_GROUPS else "megablox"


def default_tile_m(M: int, G: int) -> int:
  """Rows per tile: the largest power of two in [8, 128] whose G - 1
  partial tiles add at most a quarter of M (the xla path's bound on extra
  work), and no larger than M rounded up to 8."""
  tm = DEFAULT_TILE_M
  while tm > 8 and (G - 1) * tm > M // 4:
    tm //= 2
  return min(tm, -(-M // 8) * 8)


def _check(lhs, rhs, group_sizes):
  if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
    raise ValueError(f"gmm takes lhs [M,K], rhs [G,K,N], group_sizes [G]; "
                     f"got {lhs.shape}, {rhs.shape}, {group_sizes.shape}.")
  if lhs.shape[1] != rhs.shape[1] or rhs.shape[0] != group_sizes.shape[0]:
    raise ValueError(f"gmm: lhs [M,K] = {lhs.shape}, rhs [G,K,N] = "
                     f"{rhs.shape} and group_sizes [G] = "
                     f"{group_sizes.shape} disagree.")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"gmm: group_sizes must be integers, got "
                     f"{group_sizes.dtype}.")


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
        impl: str = "auto", tile_m: Optional[int] = None,
        rows: Optional[int] = None) -> jax.Array:
  """`lhs`'s row groups times their matrices (see the module docstring).

  Args:
    lhs: [M,K] rows sorted by group.
    rhs: [G,K,N] one matrix per group.
    group_sizes: [G] int rows per group, summing to at most M.
    impl: "auto", "xla", "megablox" or "ragged_dot".
    tile_m: rows per tile (default: `default_tile_m(M, G)` for "xla",
      `MEGABLOX_TILE_M` for "megablox").
    rows: the rows the groups cover on average, when the caller knows it
      ahead (an exchange buffer's mean fill; default M). It changes no
      number: it is written into the megablox calls' name scope
      (`ROWS_SCOPE`) for readers of the compiled program's cost.

  Returns:
    [M,N] in `lhs`'s dtype (float32 accumulation).

  Raises:
    ValueError: shapes that disagree, or an unknown impl.
  """
  _check(lhs, rhs, group_sizes)
  impl = resolve_impl(impl, rhs.shape[0])
  group_sizes = group_sizes.astype(jnp.int32)
  # Inside `jax.shard_map` the matrices are usually the same on every
  # device and the rows not: typed as varying here, so that their
  # cotangent is summed over the devices by JAX's own transpose.
  rhs = varying_like(rhs.astype(lhs.dtype), lhs)
  group_sizes = varying_like(group_sizes, lhs)
  M, K = lhs.shape
  if impl == "ragged_dot":
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)
  if impl == "megablox":
    # The kernel visits only the tiles that hold rows (a dynamic grid):
    # full-size tiles cost nothing extra there.
    tm = tile_m or min(MEGABLOX_TILE_M, -(-M // 16) * 16)
    return _megablox(lhs, rhs, group_sizes, tm, M if rows is None else rows)
  tm = tile_m or default_tile_m(M, rhs.shape[0])
  return _xla_gmm(lhs, rhs, group_sizes, tm)


# The name scope of a megablox call whose groups cover (on average) R of
# its M rows: the kernels' cost estimates count all M rows, while their
# grids visit only the tiles that hold rows, so a reader of the compiled
# program's cost (testbed/hlo_flops.py) scales them by R / M.
ROWS_SCOPE = "gmm_rows_{}_of_{}"
_ROWS = re.compile(r"\b" + ROWS_SCOPE.format(r"(\d+)", r"(\d+)") + r"\b")


def stated_rows(op_name: str) -> Optional[tuple[int, int]]:
  """(R, M) of the innermost `ROWS_SCOPE` in a JAX op name, or None."""
  found = _ROWS.findall(op_name)
  return tuple(map(int, found[-1])) if found else None


def _megablox(lhs, rhs, group_sizes, tm, rows):
  """JAX's TPU grouped matmul kernels (interpret mode on CPU)."""
  _, K, N = rhs.shape
  tiling = (tm, min(K, 512), min(N, 512))
  with jax.named_scope(ROWS_SCOPE.format(rows, lhs.shape[0])):
    return _megablox_call(lhs, rhs, group_sizes, tiling,
                          jax.default_backend() == "cpu", rows)


def _megablox_kernels():
  """The kernel module (the package's `gmm` attribute is the function)."""
  return importlib.import_module(
      "jax.experimental.pallas.ops.tpu.megablox.gmm")


def _megablox_rows(lhs, rhs, group_sizes, tiling, interpret, transpose):
  """`gmm` on whole row tiles, rows past the groups zeroed (the kernel
  leaves them unwritten)."""
  M, tm = lhs.shape[0], tiling[0]
  out = _megablox_kernels().gmm(
      _pad_rows(lhs, -(-M // tm) * tm), rhs, group_sizes, lhs.dtype, tiling,
      transpose_rhs=transpose, interpret=interpret)[:M]
  used = jnp.arange(M) < jnp.sum(group_sizes)
  return jnp.where(used[:, None], out, jnp.zeros((), out.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _megablox_call(lhs, rhs, group_sizes, tiling, interpret, rows):
  del rows
  return _megablox_rows(lhs, rhs, group_sizes, tiling, interpret, False)


def _megablox_fwd(lhs, rhs, group_sizes, tiling, interpret, rows):
  out = _megablox_call(lhs, rhs, group_sizes, tiling, interpret, rows)
  return out, (lhs, rhs, group_sizes)


def _megablox_bwd(tiling, interpret, rows, residuals, dout):
  lhs, rhs, group_sizes = residuals
  M, tm = lhs.shape[0], tiling[0]
  with jax.named_scope(ROWS_SCOPE.format(rows, M)):
    dlhs = _megablox_rows(dout, rhs, group_sizes, tiling, interpret, True)
    Mp = -(-M // tm) * tm
    drhs = _megablox_kernels().tgmm(
        _pad_rows(lhs, Mp).swapaxes(0, 1), _pad_rows(dout, Mp),
        group_sizes, rhs.dtype, tiling, num_actual_groups=rhs.shape[0],
        interpret=interpret)
  return dlhs, drhs, None


_megablox_call.defvjp(_megablox_fwd, _megablox_bwd)


# ---------------------------------------------------------------------------
# The XLA path.


def _work_items(group_sizes, num_tiles, tm):
  """The (tile, group) pairs whose rows overlap, in row order.

  Returns:
    (tile [I], group [I], valid [I] bool, starts [G], ends [G]) with
    I = num_tiles + G - 1 static; items past the real count are invalid.
  """
  G = group_sizes.shape[0]
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  first = starts // tm
  count = jnp.where(group_sizes > 0, (ends - 1) // tm - first + 1, 0)
  item_end = jnp.cumsum(count)
  item = jnp.arange(num_tiles + G - 1, dtype=jnp.int32)
  group = jnp.searchsorted(item_end, item, side="right").astype(jnp.int32)
  valid = group < G
  group = jnp.minimum(group, G - 1)
  tile = first[group] + item - (item_end[group] - count[group])
  return jnp.where(valid, tile, 0), group, valid, starts, ends


# The name scope that tells a reader of the compiled program (e.g.
# testbed/hlo_flops.py) a data-dependent loop's largest trip count.
MAX_TRIPS_SCOPE = "loop_max_trips_{}"


def _item_loop(items, body, init):
  """`fori_loop` over the real work items, its bound in its name scope."""
  with jax.named_scope(MAX_TRIPS_SCOPE.format(items[0].shape[0])):
    return jax.lax.fori_loop(0, _item_count(items), body, init)


def _item_count(items):
  """The real work items (they come first): the loop's trip count, so
  that rows past the groups (an exchange buffer's padding) cost nothing.
  The loop runs inside the custom VJP and is never differentiated."""
  return jnp.sum(items[2].astype(jnp.int32))


def _tile_rows(x, items, i, tm):
  """Item i's tile of `x` [Mp,...] masked to its group's rows; row offset."""
  tile, group, valid, starts, ends = items
  g = group[i]
  r0 = tile[i] * tm
  rows = r0 + jnp.arange(tm, dtype=jnp.int32)
  mask = valid[i] & (rows >= starts[g]) & (rows < ends[g])
  x_t = jax.lax.dynamic_slice_in_dim(x, r0, tm)
  return jnp.where(mask[:, None], x_t, jnp.zeros((), x.dtype)), g, r0


def varying_like(x, *refs):
  """`x` typed as varying over the mesh axes `refs` vary over (inside
  `jax.shard_map`, a loop carry must have its body's output type)."""
  def varying(a):
    kind = getattr(jax.typeof(a), "manual_axis_type", None)
    return set(kind.varying) if kind is not None else set()

  axes = set().union(*map(varying, refs)) - varying(x)
  return jax.lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def _pad_rows(x, Mp):
  return jnp.pad(x, ((0, Mp - x.shape[0]), (0, 0)))


def _loop_gmm(lhs, rhs, group_sizes, tm):
  """out [M,N] float32 by the loop over work items."""
  M = lhs.shape[0]
  Mp = -(-M // tm) * tm
  items = _work_items(group_sizes, Mp // tm, tm)
  x = _pad_rows(lhs, Mp)

  def body(i, out):
    x_t, g, r0 = _tile_rows(x, items, i, tm)
    y = jnp.dot(x_t, rhs[g], preferred_element_type=jnp.float32)
    cur = jax.lax.dynamic_slice_in_dim(out, r0, tm)
    return jax.lax.dynamic_update_slice_in_dim(out, cur + y, r0, 0)

  out = varying_like(jnp.zeros((Mp, rhs.shape[2]), jnp.float32), lhs, rhs,
                      group_sizes)
  return _item_loop(items, body, out)[:M]


def _loop_weight_grad(lhs, dout, group_sizes, num_groups, tm):
  """drhs [G,K,N] float32: sum over items of `lhs_tile^T dout_tile`."""
  M = lhs.shape[0]
  Mp = -(-M // tm) * tm
  items = _work_items(group_sizes, Mp // tm, tm)
  x, dy = _pad_rows(lhs, Mp), _pad_rows(dout, Mp)

  def body(i, acc):
    x_t, g, r0 = _tile_rows(x, items, i, tm)
    dy_t = jax.lax.dynamic_slice_in_dim(dy, r0, tm)
    d = jax.lax.dot_general(x_t, dy_t, (((0,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return acc.at[g].add(d)

  acc = varying_like(
      jnp.zeros((num_groups, lhs.shape[1], dout.shape[1]), jnp.float32),
      lhs, dout, group_sizes)
  return _item_loop(items, body, acc)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _xla_gmm(lhs, rhs, group_sizes, tm):
  return _loop_gmm(lhs, rhs, group_sizes, tm).astype(lhs.dtype)


def _xla_gmm_fwd(lhs, rhs, group_sizes, tm):
  return _xla_gmm(lhs, rhs, group_sizes, tm), (lhs, rhs, group_sizes)


def _xla_gmm_bwd(tm, residuals, dout):
  lhs, rhs, group_sizes = residuals
  dlhs = _loop_gmm(dout, jnp.swapaxes(rhs, 1, 2), group_sizes, tm)
  drhs = _loop_weight_grad(lhs, dout, group_sizes, rhs.shape[0], tm)
  # Rows past the groups get no gradient (ragged_dot's rule as well).
  return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype), None


_xla_gmm.defvjp(_xla_gmm_fwd, _xla_gmm_bwd)
