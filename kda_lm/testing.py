"""Helpers shared by the tests and the benchmarks: the error metric,
random KDA inputs, a small text corpus (and documents and a released-model
style `tokenizer.json` for the corpus-source tests) and the row-continuity
measurement of packed streams.

Error metric. `rel_err(a, b) = ||a - b||_2 / ||b||_2` over the whole array,
in float64 (0 when both are exactly zero). A norm-wise error does not blow up
on the many entries that are near zero (where an element-wise rtol is
meaningless) and is invariant to the array's size and scale; it is FLA's
`get_err_ratio` (relative RMS).

`kda_float64` is the op's oracle for accuracy checks: the token-by-token
reference run in float64, so a float32 implementation's error against it is
its own error, not the difference of two float32 roundings.

Inputs use FLA's test distributions; shapes follow `kda_lm.ops.chunk_kda`.
The KDA op tests share their shapes, inputs, error report and compiled
forward+gradient calls from here (`KDA_*`, `kda_fwd_and_grads`); the
training tests their tiny model config and stand-in batches
(`tiny_train_config`, `table_batch`).
"""

import collections
import contextlib
import functools
import os
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from kda_lm.ops.kda import api, common, reference
from kda_lm.parallel import distributed, sharding

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


def sigmoid(x):
  """The logistic function, in numpy."""
  return 1.0 / (1.0 + np.exp(-x))


def logsigmoid(x):
  """log(sigmoid(x)), in numpy, stable for large |x|."""
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
      in-kernel softplus form), "safe" (raw gates, in-kernel
      lower_bound=-5 form with safe_gate=True) or "floor" (as "safe", with
      every gate within 1% of the floor -5).
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
  params = dict(q=q, k=k, v=v, beta=sigmoid(randn(B, T, H)))
  static = dict(use_qk_l2norm_in_kernel=l2norm)
  if gate == "pre":
    g = logsigmoid(x)
  elif gate == "softplus":
    g = x
    params["A_log"] = np.log(rng.uniform(1, 16, H)).astype(np.float32)
    params["dt_bias"] = randn(H * K)
    static["use_gate_in_kernel"] = True
  elif gate in ("safe", "floor"):  # floor: every gate within 1% of -5
    floor = gate == "floor"
    g = 4.6 + 0.5 * np.abs(x) if floor else x
    params["A_log"] = (np.zeros(H) if floor else rng.uniform(-1, 1, H)
                       ).astype(np.float32)
    params["dt_bias"] = np.zeros(H * K) if floor else randn(H * K)
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


# ----------------------------------------------------------------------------
# The KDA op tests (tests/ops_kda_*_test.py): shapes, inputs, compiled calls.
#
# Every implementation in `KDA_IMPLS_UNDER_TEST`, and the float32
# "reference" itself, is checked against `kda_float64` and FLA's golden
# fixture, and against the packing / causality / validation contracts. A new
# implementation (e.g. "pallas") is tested by adding its name to
# `KDA_IMPLS_UNDER_TEST`.
#
# Compile budget. Compiling the chunked forward+backward costs seconds, so
# the op tests share a few shapes (`KDA_B, KDA_H, KDA_K, KDA_V`,
# `KDA_PACKED_T`) and one jitted forward+gradient function per (impl, static
# config), cached for the whole process by `kda_fwd_and_grads`; checks that
# need several calls reuse one compiled shape.

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
    o, s = api.chunk_kda(**params, segment_ids=segment_ids,
                         output_final_state=True, impl=impl, **kw)
    value = jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(s * dht)
    return value, (o, s)

  return jax.jit(jax.grad(loss, has_aux=True))


def kda_fwd_and_grads(impl, params, do, dht, segment_ids=None, fresh=False,
                      **static):
  """Returns numpy (o, final_state, {name: grad}) from one compiled call;
  `fresh` compiles anew (under the current XLA settings), uncached."""
  make = _grad_fn.__wrapped__ if fresh else _grad_fn
  grads, (o, s) = make(impl, _freeze(static))(params, segment_ids, do, dht)
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
  return kda_inputs(rng, b, t, KDA_H, KDA_K, KDA_V, **kwargs)


def kda_test_cotangents(rng, o_shape, n_states):
  """`kda_cotangents` at the op tests' K."""
  return kda_cotangents(rng, o_shape, n_states, KDA_K)


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


def corpus_texts(num: int, seed: int = 0) -> list[str]:
  """`num` distinct documents for the corpus-source tests: 1 to ~150
  characters of ASCII, accents, CJK, an emoji, newlines, tabs, quotes and
  backslashes (what JSON escapes), each ending in its index."""
  rng = np.random.default_rng(seed)
  words = ["def", "x", "café", "naïve", "名前", "データ", "🐍", "\n", "\t",
           '"q"', "\\", "a\r\nb", "   ", "{}", "[1, 2]"]
  return ["".join(rng.choice(words, int(rng.integers(0, 24))).tolist())
          + f" #{i}" for i in range(num)]


def write_hf_tokenizer(path: str, texts: Sequence[str],
                       vocab_size: int = 320) -> str:
  """Writes a released-model-like `tokenizer.json`: byte-level BPE learnt on
  `texts`, special tokens `<s>` (0) and `</s>` (1), and a template that puts
  `<s>` in front of every text. Returns `path`."""
  # Not at the top: most users of this module do not need tokenizers.
  import tokenizers  # pylint: disable=g-import-not-at-top
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
      add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  tok.post_processor = tokenizers.processors.TemplateProcessing(
      single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tok.save(path)
  return path


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


# ----------------------------------------------------------------------------
# The training tests (tests/train_*_test.py, checkpoint_state_test.py): a
# tiny delayed-copy model's config and stand-in batches.

# A 2-layer KDA + MLA model on delayed copy (delay 4) with 4 x 32 batches.
TINY_TRAIN_OVERRIDES = {
    "model.d_model": 32,
    "model.attention_pattern": "KM",
    "model.num_heads": 2,
    "model.head_dim": 16,
    "model.kv_lora_rank": 16,
    "model.qk_nope_head_dim": 16,
    "model.qk_rope_head_dim": 8,
    "model.v_head_dim": 16,
    "model.mlp_hidden_dim": 64,
    "data.seq_len": 32,
    "data.batch_size": 4,
    "data.vocab_size": 16,
    "data.delay": 4,
    "data.min_len": 8,
    "data.max_len": 40,
    "data.num_train_docs": 256,
    "data.num_eval_docs": 16,
    "data.shuffle_buffer": 64,
    "data.pack_window_rows": 8,
    "opt.warmup_steps": 2,
    # Fixed, so that runs of any length share one compiled update step.
    "opt.decay_steps": 6,
    "opt.peak_lr": 1e-2,
    "train.num_steps": 4,
    "train.log_every": 1,
    "train.progress_bar": False,
    "eval.every_steps": 2,
    "eval.num_batches": 2,
    "checkpoint.every_steps": 2,
}


def tiny_train_overrides(data_dir, **extra):
  """TINY_TRAIN_OVERRIDES with the data dir and `extra` keys given as
  `section__name=value`; a dict of "section.name" to value."""
  values = dict(TINY_TRAIN_OVERRIDES)
  values["data.data_dir"] = data_dir
  values.update({k.replace("__", "."): v for k, v in extra.items()})
  return values


def tiny_train_config(data_dir, **extra):
  """ling3_tiny with TINY_TRAIN_OVERRIDES; extra keys as
  `section__name=value`."""
  # Not at the top: configs imports the data pipeline (TensorFlow), which
  # most users of this module do not need.
  from configs import ling3_tiny  # pylint: disable=g-import-not-at-top
  config = ling3_tiny.get_config()
  for key, value in tiny_train_overrides(data_dir, **extra).items():
    section, name = key.split(".")
    config[section][name] = value
  return config


def table_batch(rng, vocab, rows, t, n_real):
  """A batch whose first `n_real` positions (row-major) carry loss_mask 1."""
  mask = np.zeros(rows * t, np.float32)
  mask[:n_real] = 1.0
  return {"inputs": rng.integers(0, vocab, (rows, t)).astype(np.int32),
          "targets": rng.integers(0, vocab, (rows, t)).astype(np.int32),
          "segment_ids": np.ones((rows, t), np.int32),
          "positions": np.tile(np.arange(t, dtype=np.int32), (rows, 1)),
          "loss_mask": mask.reshape(rows, t)}


def one_device_batch_sharding():
  """The batch sharding of a one-device (data=1, fsdp=1) mesh."""
  mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": 1,
                                                       "fsdp": 1}),
                            jax.devices()[:1])
  return sharding.batch_sharding(mesh)
