"""Helpers shared by the test modules; no test module imports another.

- The model tests' tiny config and packed row (`VOCAB`, `T`, `LENS`,
  `STARTS`, `tiny_config`, `packed_row`, `doc`, `alone_rows`).
- The evaluation and generation tests' tiny model (`tiny_model_config`).
- The loss tests' packed row (`LOSS_ROW`).
- `record_rope`: the RoPE calls of a jitted function.
- Data iterators (`train_iterator`, `take`, `assert_same_batches`,
  `assert_resumes_exactly`).
- Training runs: `train.py` in a subprocess on a generated config file
  (`write_config_file`, `train_command`, `run_train`, `train_rows`), and a
  stand-in run for the loop's log rows (`Clock`, `LoopRun`).

(Fixtures live in conftest.py; metrics and oracles in `kda_lm.testing`.)
"""

import functools
import os
import subprocess
import sys
import types

import jax
import ml_collections
import numpy as np

from configs import ling3_tiny
from data import pipeline
from kda_lm import testing
from kda_lm.layers import rope
from kda_lm.train import loop as train_loop
from kda_lm.train import metrics, preemption

VOCAB, T = 32, 128
LENS = (3, 70, 40)   # < conv window; crosses the 64-token chunk boundary.
STARTS = (0, 3, 73)  # then 15 padding tokens.


def tiny_config(**overrides):
  """ling3_tiny's model dict shrunk for tests (d_model 32, vocab 32)."""
  m = ling3_tiny.model_config()
  m.update(dict(vocab_size=VOCAB, d_model=32, num_heads=2, head_dim=16,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=16, mlp_hidden_dim=64, moe_intermediate_size=32,
                kda_impl="xla"))
  m.update(overrides)
  return m


def packed_row(seed):
  """[1,T] tokens and segment ids: documents of LENS at STARTS, padding
  after."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, (1, T)).astype(np.int32)
  seg = np.zeros((1, T), np.int32)
  for i, (s, n) in enumerate(zip(STARTS, LENS, strict=True)):
    seg[0, s:s + n] = i + 1
  tokens[seg == 0] = 0
  return tokens, seg


def doc(x, i):
  """Document i's positions of a [1,T,...] array."""
  return x[:, STARTS[i]:STARTS[i] + LENS[i]]


def alone_rows(tokens, seg):
  """Row 0 packed, row 1 + i: document i alone at a row start, padded."""
  rows, segs = [tokens[0]], [seg[0]]
  for i, n in enumerate(LENS):
    rows.append(np.pad(doc(tokens, i)[0], (0, T - n)))
    segs.append(np.pad(np.ones(n, np.int32), (0, T - n)))
  return np.stack(rows), np.stack(segs)


def tiny_model_config(m):
  """Shrinks ling3_tiny's `model` section in place to a dense "KM" model
  (the evaluation and generation tests' model)."""
  m.d_model, m.num_heads, m.head_dim = 32, 2, 8
  m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim = 16, 8, 4
  m.v_head_dim, m.mlp_hidden_dim = 8, 32
  m.attention_pattern, m.num_experts = "KM", 0
  m.kda_chunk_size = 16
  return m


# Documents A = 10 11 12 13 and B = 20 21 22 23 24 packed as
# `data/packing.py` does (inputs t[:-1], targets t[1:]), then padding.
LOSS_ROW = dict(
    inputs=np.array([[10, 11, 12, 20, 21, 22, 23, 0]], np.int32),
    targets=np.array([[11, 12, 13, 21, 22, 23, 24, 0]], np.int32),
    segment_ids=np.array([[1, 1, 1, 2, 2, 2, 2, 0]], np.int32),
    loss_mask=np.array([[1, 1, 1, 1, 1, 1, 1, 0]], np.float32))


def record_rope(monkeypatch):
  """Makes `rope.apply_rope` record (positions, rotated output) per call;
  returns `run(f, *args)`: jit(f)(*args)'s recorded calls, as numpy."""
  calls = []
  apply_rope = rope.apply_rope

  def recording(x, positions, theta, scaling=rope.NO_SCALING):
    out = apply_rope(x, positions, theta, scaling)
    calls.append((positions, out))
    return out

  def traced(f, *args):
    calls.clear()
    f(*args)
    return list(calls)

  monkeypatch.setattr(rope, "apply_rope", recording)
  return lambda f, *args: jax.tree.map(
      np.asarray, jax.jit(functools.partial(traced, f))(*args))


def train_iterator(config, data_dir, **kwargs):
  """`pipeline.make_train_iterator` as process 0 of 1 by default."""
  kwargs.setdefault("process_index", 0)
  kwargs.setdefault("process_count", 1)
  return pipeline.make_train_iterator(config, data_dir=data_dir, **kwargs)


def take(iterator, n):
  return [next(iterator) for _ in range(n)]


def assert_same_batches(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b, strict=True):
    assert x.keys() == y.keys()
    for key in x:
      np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def assert_resumes_exactly(config, data_dir, ckpt_dir, skip, take_n):
  """Saves a train iterator after `skip` batches; a new iterator restored
  from it gives the `take_n` batches the first one gives next."""
  it = train_iterator(config, data_dir)
  take(it, skip)
  it.save(ckpt_dir)
  expected = take(it, take_n)
  resumed = train_iterator(config, data_dir)
  resumed.restore(ckpt_dir)
  assert_same_batches(take(resumed, take_n), expected)


# Training runs.

CONFIG_FILE = """
from configs import ling3_tiny

OVERRIDES = {overrides!r}


def get_config(arg=None):
  config = ling3_tiny.get_config(arg)
  for key, value in OVERRIDES.items():
    section, name = key.split(".")
    config[section][name] = value
  return config
"""


def write_config_file(tmp_path, data_dir, **extra):
  path = tmp_path / f"config_{len(os.listdir(tmp_path))}.py"
  path.write_text(CONFIG_FILE.format(overrides=testing.tiny_train_overrides(
      data_dir, **extra)))
  return str(path)


def train_command(config_file, workdir, *flags):
  return [sys.executable, os.path.join(testing.REPO, "train.py"),
          f"--config={config_file}", f"--workdir={workdir}", *flags]


def run_train(config_file, workdir, cache_dir, *flags, xla_flags="",
              timeout=300):
  result = subprocess.run(
      train_command(config_file, workdir, *flags), cwd=testing.REPO,
      env=testing.subprocess_env(cache_dir, xla_flags), capture_output=True,
      text=True, timeout=timeout, check=False)
  assert result.returncode == 0, result.stderr[-4000:]
  return result


def train_rows(workdir):
  return [r for r in metrics.read_metrics(workdir) if "loss" in r]



class Clock:
  """Stands in for the `time` module inside kda_lm.train.metrics."""

  def __init__(self):
    self.now = 1000.0

  def time(self):
    return self.now


class LoopRun:
  """The parts of `train_loop._Run` that `_train_loop` uses: steps with known
  metrics that take known (fake) times, log rows recorded."""

  check_finite = train_loop._Run.check_finite  # pylint: disable=protected-access
  log_startup = train_loop._Run.log_startup  # pylint: disable=protected-access
  phases = ()

  def __init__(self, clock, num_steps, log_every, ckpt_every):
    self.cfg = ml_collections.ConfigDict({
        "train": {"num_steps": num_steps, "log_every": log_every},
        "eval": {"every_steps": 0},
        "checkpoint": {"every_steps": ckpt_every},
        "data": {"batch_size": 2, "seq_len": 4},
        "model": {"vocab_size": 11}})
    self.clock = clock
    self.start_step = 0
    self.cache_counts = train_loop.CacheCounts()
    self.manager = None
    self.eval_batches = None
    self.last_checkpoint = None
    rng = np.random.default_rng(0)
    self.train_it = iter(lambda: testing.table_batch(rng, 11, 2, 4, 8), None)
    self.steps = types.SimpleNamespace(
        update=self.update, batch_sharding=testing.one_device_batch_sharding(),
        flops_per_token=0.0)
    self.output = types.SimpleNamespace(
        train_row=self.log_row,
        writer=types.SimpleNamespace(flush=lambda: None))
    self.rows, self.checkpoints = [], []
    self.preemption = preemption.Preemption(multi_process=False)
    self.save_clock = preemption.SaveClock(None)

  @staticmethod
  def loss(step):
    return float(step * step)

  def update(self, state, batch):
    del batch
    step = int(state) + 1
    self.clock.now += 100.0 if step == 1 else 2.0   # Step 1 compiles.
    return step, {"loss": jax.numpy.float32(self.loss(step)),
                  "accuracy": jax.numpy.float32(step / 10),
                  "grad_norm": jax.numpy.float32(1.0),
                  "update_norm": jax.numpy.float32(1.0),
                  "lr": jax.numpy.float32(step * 1e-3)}

  def log_row(self, step, row):
    self.rows.append((step, row))

  def checkpoint(self, step, state, wait=False):
    del state
    self.checkpoints.append((step, "wait") if wait else step)
    self.clock.now += 50.0    # Left out of tokens/s (window.paused).
    self.save_clock.saved()

  def preempted(self, step):
    return preemption.Preempted(step, "the test")

  def finish(self, state):
    del state


def jaxpr_eqns(jaxpr):
  """Every equation of a jaxpr and its sub-jaxprs, kernel bodies excluded."""
  for eqn in jaxpr.eqns:
    yield eqn
    if eqn.primitive.name == "pallas_call":
      continue
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from jaxpr_eqns(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from jaxpr_eqns(sub)
