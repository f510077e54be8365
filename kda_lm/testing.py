"""Helpers shared by the tests and the benchmarks: the error metric,
random KDA inputs, a small text corpus and the row-continuity measurement
of packed streams.

Error metric. `rel_err(a, b) = ||a - b||_2 / ||b||_2` over the whole array,
in float64 (0 when both are exactly zero). A norm-wise error does not blow up
on the many entries that are near zero (where an element-wise rtol is
meaningless) and is invariant to the array's size and scale; it is FLA's
`get_err_ratio` (relative RMS).

`kda_float64` is the op's oracle for accuracy checks: the token-by-token
reference run in float64, so a float32 implementation's error against it is
its own error, not the difference of two float32 roundings.

Inputs use FLA's test distributions; shapes follow `kda_lm.ops.chunk_kda`
(B rows, T tokens, H heads, K key dim, V value dim, N documents).
"""

import collections
import contextlib
import os
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kda_lm import distributed
from kda_lm.ops.kda import common, reference

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def most_optimizations_disabled(disabled: bool = True):
  """Sets `jax_disable_most_optimizations` inside, restoring it after.

  The flag is read when compiling and is not part of jit's cache key: a
  function compiled before keeps its executable.
  """
  previous = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", disabled)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", previous)


def subprocess_env(cache_dir: str | None = None, xla_flags: str = ""
                   ) -> dict[str, str]:
  """The environment of a test's Python subprocess (train.py, checks).

  The repository on PYTHONPATH, CPU only, most XLA optimizations skipped
  (tiny shapes, where compilation dominates; as the tests' `fast_compile`
  fixture), no CPU-collectives choice inherited (multi-process runs pick
  gloo themselves).

  Args:
    cache_dir: a persistent compilation cache shared by the subprocesses
      (every compile cached), or None.
    xla_flags: appended to XLA_FLAGS (e.g. fake device counts).

  Returns:
    A copy of `os.environ` with those settings.
  """
  env = dict(os.environ)
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  env["JAX_PLATFORMS"] = "cpu"
  if cache_dir is not None:
    env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true"
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
  env.pop(distributed.CPU_COLLECTIVES_ENV, None)
  return env


def rel_err(a: Any, b: Any) -> float:
  """`||a - b||_2 / ||b||_2` in float64; 0 if both are exactly zero, inf if
  only `b` is.

  Raises:
    AssertionError: the shapes differ.
  """
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  assert a.shape == b.shape, (a.shape, b.shape)
  num = np.linalg.norm((a - b).ravel())
  den = np.linalg.norm(b.ravel())
  if den == 0.0:
    return 0.0 if num == 0.0 else float("inf")
  return float(num / den)


def kda_float64(params: dict[str, np.ndarray], do: np.ndarray,
                dht: np.ndarray, segment_ids: np.ndarray | None = None,
                scale: float | None = None, **static: Any
                ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
  """The reference recurrence and its gradients in float64.

  Args:
    params: `chunk_kda` arrays by name (as `kda_inputs` makes them; no
      cu_seqlens).
    do: [B,T,H,V] cotangent of o; dht: [B,H,K,V] cotangent of the final
      state (the loss is `sum(o * do) + sum(final_state * dht)`).
    segment_ids: [B,T] int or None.
    scale: the query scale (default K**-0.5).
    **static: `use_gate_in_kernel`, `lower_bound`, `use_qk_l2norm_in_kernel`
      (`safe_gate` and `chunk_size` do not change the result).

  Returns:
    float64 numpy (o, final_state, {name: gradient}).
  """
  B, T, H, K = params["q"].shape
  scale = K ** -0.5 if scale is None else scale
  ids = np.ones((B, T), np.int32) if segment_ids is None else segment_ids
  with jax.enable_x64(True):
    segs = common.segments_from_ids(jnp.asarray(ids))

    def loss(p):
      q, k, v, g, beta = common.canonicalize(
          p["q"], p["k"], p["v"], p["g"], p["beta"], segs,
          A_log=p.get("A_log"), dt_bias=p.get("dt_bias"),
          lower_bound=static.get("lower_bound"),
          use_gate_in_kernel=static.get("use_gate_in_kernel", False),
          use_qk_l2norm_in_kernel=static.get("use_qk_l2norm_in_kernel",
                                             False), dtype=jnp.float64)
      h0 = p.get("initial_state", jnp.zeros((B, H, K, v.shape[-1]),
                                            jnp.float64))
      o, s = reference.kda_recurrent(q, k, v, g, beta, segs, h0, scale)
      return jnp.sum(o * do) + jnp.sum(s * dht), (o, s)

    p64 = {n: jnp.asarray(a, jnp.float64) for n, a in params.items()}
    grads, (o, s) = jax.jit(jax.grad(loss, has_aux=True))(p64)
    return jax.tree.map(np.asarray, (o, s, grads))


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _logsigmoid(x):
  return -np.logaddexp(0.0, -x)


def _add_spikes(rng, g):
  """-1000 gates (hard resets): a full token, half the channels of token 64
  (a chunk's first row) and scattered entries."""
  g = g.copy()
  t, K = g.shape[1], g.shape[-1]
  g[:, min(10, t - 1)] = -1000.0
  if t > 64:
    g[:, 64, :, : K // 2] = -1000.0
  g[rng.random(g.shape) < 0.01] = -1000.0
  return g


def kda_inputs(rng: np.random.Generator, B: int, T: int, H: int, K: int,
               V: int, *, gate: str = "pre", l2norm: bool = False,
               h0: bool = True, spikes: bool = False
               ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
  """Random float32 `chunk_kda` inputs in FLA's test distributions.

  Args:
    rng: numpy Generator.
    B, T, H, K, V: the shapes.
    gate: "pre" (pre-activated logsigmoid gates), "softplus" (raw gates, the
      in-kernel softplus form) or "safe" (raw gates, in-kernel
      lower_bound=-5 form with safe_gate=True).
    l2norm: use_qk_l2norm_in_kernel; when off, k is L2-normalised here (as
      in FLA's tests) so the delta rule stays contractive.
    h0: pass a random initial_state [B,H,K,V].
    spikes: hard resets in the gates (with gate="pre" only).

  Returns:
    (params dict for chunk_kda, static kwargs dict).

  Raises:
    ValueError: an unknown gate, or spikes with another gate than "pre".
  """
  randn = lambda *s: rng.standard_normal(s).astype(np.float32)
  q, k, v, x = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V), randn(
      B, T, H, K)
  if not l2norm:
    k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
  params = dict(q=q, k=k, v=v, beta=_sigmoid(randn(B, T, H)))
  static = dict(use_qk_l2norm_in_kernel=l2norm)
  if gate == "pre":
    g = _logsigmoid(x)
  elif gate == "softplus":
    g = x
    params["A_log"] = np.log(rng.uniform(1, 16, H)).astype(np.float32)
    params["dt_bias"] = randn(H * K)
    static["use_gate_in_kernel"] = True
  elif gate == "safe":
    g = x
    params["A_log"] = rng.uniform(-1, 1, H).astype(np.float32)
    params["dt_bias"] = randn(H * K)
    static.update(use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True)
  else:
    raise ValueError(f"Unknown gate {gate!r}.")
  if spikes:
    if gate != "pre":
      raise ValueError("spikes need gate='pre'.")
    g = _add_spikes(rng, g)
  params["g"] = g.astype(np.float32)
  if h0:
    params["initial_state"] = randn(B, H, K, V)
  params = {n: np.asarray(a, np.float32) for n, a in params.items()}
  return params, static


def kda_cotangents(rng: np.random.Generator, o_shape: tuple[int, ...],
                   N: int, K: int) -> tuple[np.ndarray, np.ndarray]:
  """float32 cotangents: `do` like o [B,T,H,V] and `dht` [N,H,K,V]."""
  do = rng.standard_normal(o_shape).astype(np.float32)
  H, V = o_shape[2], o_shape[3]
  dht = rng.standard_normal((N, H, K, V)).astype(np.float32)
  return do, dht


def document_ids(rng: np.random.Generator, B: int, T: int, docs: int
                 ) -> np.ndarray:
  """[B,T] int32 segment ids: each row `docs` contiguous documents of random
  lengths (ids 1..docs, no padding); all zeros when `docs` is 0."""
  ids = np.zeros((B, T), np.int32)
  for b in range(B if docs > 0 else 0):
    cuts = np.sort(rng.choice(np.arange(1, T), docs - 1, replace=False))
    ids[b] = np.searchsorted(cuts, np.arange(T), side="right") + 1
  return ids


def write_text_corpus(root: str, num_files: int = 8) -> dict[str, str]:
  """Writes a small UTF-8 text corpus for the text_files tests.

  Files `f{i}.txt` under `root` mix ASCII code, non-ASCII text (accents,
  CJK, an emoji), empty lines, tabs and a carriage return.

  Returns:
    `{file name: its text}`.
  """
  import os  # pylint: disable=g-import-not-at-top
  os.makedirs(root, exist_ok=True)
  lines = ["def f(x):", "    return x * 2", "", "# café — naïve ☕",
           "\t名前 = 'データ'  # 🐍", "", "", "class A:\r", "  pass"]
  out = {}
  for i in range(num_files):
    text = "\n".join(lines[i % 3:] + lines[:i % 3]) * (i + 1) + f"\n# {i}\n"
    name = f"f{i}.txt"
    with open(os.path.join(root, name), "w", encoding="utf-8",
              newline="") as f:
      f.write(text)
    out[name] = text
  return out


def piece_index(documents: Iterable[np.ndarray], seq_len: int
                ) -> dict[bytes, set[tuple[int, int, int]]]:
  """Maps each piece's input tokens to its `(document, piece, pieces)`.

  A piece is what the packer makes of a document: `seq_len` pairs starting
  at pair `k * seq_len`; `pieces` is the document's number of pieces.
  Identical pieces (copied files) map to every place they occur.
  """
  index = collections.defaultdict(set)
  for d, tokens in enumerate(documents):
    inputs = np.asarray(tokens, np.int32)[:-1]
    starts = range(0, len(inputs), seq_len)
    for k, start in enumerate(starts):
      index[inputs[start:start + seq_len].tobytes()].add((d, k, len(starts)))
  return index


def _segment(row: dict[str, np.ndarray], segment: int) -> bytes:
  return row["inputs"][row["segment_ids"] == segment].tobytes()


def row_continuity(rows: Sequence[dict[str, np.ndarray]],
                   index: dict[bytes, set[tuple[int, int, int]]]
                   ) -> dict[str, float]:
  """How often consecutive rows continue one document.

  Args:
    rows: consecutive packed rows (reset mode: per-document segment ids),
      each a dict of `[seq_len]` int32 arrays.
    index: `piece_index` of the split the rows come from.

  Returns:
    `continuing`: share of rows (after the first) whose first segment is the
    next piece of a document whose piece ends the previous row;
    `single_piece`: share of rows that are one piece of a document of
    several pieces.
  """
  continuing = single = 0
  previous = set()
  for row in rows:
    segments = int(row["segment_ids"].max())
    first = index.get(_segment(row, 1), set())
    continuing += any((d, k + 1, n) in first for d, k, n in previous)
    single += segments == 1 and any(n > 1 for _, _, n in first)
    previous = index.get(_segment(row, segments), set())
  return {"continuing": continuing / max(len(rows) - 1, 1),
          "single_piece": single / max(len(rows), 1)}
