"""Helpers shared by the test modules; no test module imports another.

- The model tests' tiny config and packed row (`VOCAB`, `T`, `LENS`,
  `STARTS`, `tiny_config`, `tiny_model`, `packed_row`, `doc`,
  `alone_rows`).
- The evaluation and generation tests' tiny model (`tiny_model_config`).
- The loss tests' packed row (`LOSS_ROW`).
- `record_rope`: the RoPE calls of a jitted function.
- Data iterators (`train_iterator`, `take`, `assert_same_batches`,
  `assert_resumes_exactly`) and corpora written to disk
  (`write_text_corpus`, `write_hf_tokenizer`: a released-model-like
  `tokenizer.json`).
- The training tests' tiny delayed-copy model and stand-in batches
  (`TINY_TRAIN_OVERRIDES`, `tiny_train_overrides`, `tiny_train_config`,
  `table_batch`, `one_device_batch_sharding`).
- The update and eval steps' stand-in model (`StandInModel`): the
  kda_lm model's interface and outputs in a few matmuls, no compile of a
  real model.
- Training runs: `train.py` in a subprocess on a generated config file
  (`write_config_file`, `train_command`, `run_train`, `train_rows`), and a
  stand-in run for the loop's log rows (`Clock`, `LoopRun`).

The other shared test modules: `process_support.py` (the repository path,
the XLA-optimization switch, a subprocess's environment), `kda_support.py`
(the KDA op tests' shapes, inputs and compiled calls); fixtures live in
conftest.py. What the experiments share with the tests (the error metric,
KDA inputs and the float64 oracle, corpus texts) lives in `testbed/`.
"""

import functools
import os
import subprocess
import sys
import types
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import process_support
import tokenizers

from configs import ling3_tiny
from data import pipeline
from kda_lm import config as config_lib
from kda_lm import model as model_lib
from kda_lm.layers import moe, rope
from kda_lm.parallel import sharding
from kda_lm.train import ahead, metrics, preemption
from kda_lm.train import loop as train_loop

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


def tiny_model(**overrides) -> config_lib.ModelConfig:
  """`tiny_config(**overrides)` read into its `ModelConfig`, as the
  library takes it."""
  return config_lib.ModelConfig.from_config(tiny_config(**overrides))


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


def write_text_corpus(root: str, num_files: int = 8) -> dict[str, str]:
  """Writes a small UTF-8 text corpus for the text_files tests.

  Files `f{i}.txt` under `root` mix ASCII code, non-ASCII text (accents,
  CJK, an emoji), empty lines, tabs and a carriage return.

  Returns:
    `{file name: its text}`.
  """
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


def write_hf_tokenizer(path: str, texts: Sequence[str],
                       vocab_size: int = 320) -> str:
  """Writes a released-model-like `tokenizer.json`: byte-level BPE learnt on
  `texts`, special tokens `<s>` (0) and `</s>` (1), and a template that puts
  `<s>` in front of every text. Returns `path`."""
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


# Training runs: a tiny delayed-copy model's config and stand-in batches,
# `train.py` in a subprocess, a stand-in run for the loop's log rows.

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
  path.write_text(CONFIG_FILE.format(overrides=tiny_train_overrides(
      data_dir, **extra)))
  return str(path)


def train_command(config_file, workdir, *flags):
  return [sys.executable, os.path.join(process_support.REPO, "train.py"),
          f"--config={config_file}", f"--workdir={workdir}", *flags]


def run_train(config_file, workdir, cache_dir, *flags, xla_flags="",
              timeout=300):
  result = subprocess.run(
      train_command(config_file, workdir, *flags), cwd=process_support.REPO,
      env=process_support.subprocess_env(cache_dir, xla_flags),
      capture_output=True, text=True, timeout=timeout, check=False)
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
  wait_for_steps = train_loop._Run.wait_for_steps  # pylint: disable=protected-access
  phases = ()
  ahead = None
  lowered = {}
  compiled_ahead = {}

  def __init__(self, clock, num_steps, log_every, ckpt_every):
    self.cfg = ml_collections.ConfigDict({
        "train": {"num_steps": num_steps, "log_every": log_every},
        "eval": {"every_steps": 0},
        "checkpoint": {"every_steps": ckpt_every},
        "data": {"batch_size": 2, "seq_len": 4},
        "model": {"vocab_size": 11}})
    self.clock = clock
    self.start_step = 0
    self.cache_counts = ahead.CacheCounts()
    self.manager = None
    self.eval_batches = None
    self.last_checkpoint = None
    rng = np.random.default_rng(0)
    self.train_it = iter(lambda: table_batch(rng, 11, 2, 4, 8), None)
    self.steps = types.SimpleNamespace(
        update=self.update, batch_sharding=one_device_batch_sharding(),
        flops_per_token=0.0)
    self.output = types.SimpleNamespace(
        train_row=self.log_row,
        writer=types.SimpleNamespace(flush=lambda: None))
    self.rows, self.checkpoints = [], []
    self.first_step_parts = []
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


class StandInModel:
  """A stand-in for `kda_lm.model.build(cfg)`'s model, in a few matmuls.

  `apply(params, inputs, segment_ids=, positions=, return_aux=, logits=)`
  returns what the real model does, from simple formulas a test can redo:
  hidden states `h = embed[inputs] * (1 + positions / 8)`, logits
  `h @ head_weight(cfg, params)`; with `return_aux`, MTP layer k's hidden
  states `tanh(h @ mtp[k])` (`mtp_hidden`, or their logits as
  `mtp_logits`) and an expert load [MoE layers + MTP layers, E] counting
  the non-padding tokens `(input + layer) % E`. `cfg=None` is a model that
  is not kda_lm's: logits only, and it takes no `logits` argument. Each
  call's `(rows, return_aux, logits)` is recorded in `calls`.
  """

  def __init__(self, cfg=None):
    self.cfg = cfg
    self.calls = []

  def init(self, seed, vocab, width):
    """Random float32 parameters, with each MoE layer's selection bias
    (`router_bias_slots`) and the MTP layers' weights."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    params = {"embed": {"embeddings": normal(vocab, width)},
              "lm_head": {"w": normal(width, vocab)}}
    cfg = self.cfg
    if cfg is not None and cfg.num_mtp_layers:
      params["mtp"] = {"w": normal(cfg.num_mtp_layers, width, width)}
    if cfg is not None and cfg.num_experts:
      for slot in model_lib.router_bias_slots(cfg):
        shape = ((len(slot.rows),) if slot.stacked else ()) + (
            cfg.num_experts,)
        params[slot.module] = {moe.BIAS_NAME: normal(*shape)}
    return params

  @staticmethod
  def hidden(params, inputs, positions):
    """The final hidden states [B,T,D]."""
    return params["embed"]["embeddings"][inputs] * (
        1.0 + positions[..., None] / 8.0)

  def apply(self, params, inputs, segment_ids=None, positions=None,
            return_aux=False, **kwargs):
    cfg = self.cfg
    assert cfg is not None or "logits" not in kwargs
    logits = kwargs.pop("logits", True)
    assert not kwargs, kwargs
    self.calls.append((inputs.shape[0], return_aux, logits))
    h = self.hidden(params, inputs, positions)
    head = (params["lm_head"]["w"] if cfg is None
            else model_lib.head_weight(cfg, params))
    out = h @ head if logits else h
    if not return_aux:
      return out
    aux = {}
    if cfg.num_mtp_layers:
      mtp_h = jnp.stack([jnp.tanh(h @ w) for w in params["mtp"]["w"]])
      aux["mtp_logits" if logits else "mtp_hidden"] = (
          mtp_h @ head if logits else mtp_h)
    if cfg.num_experts:
      layers = sum(map(cfg.is_moe_layer, range(cfg.num_layers)))
      real = (segment_ids != 0).astype(jnp.float32)[..., None]
      aux["expert_load"] = jnp.stack([
          (jax.nn.one_hot((inputs + i) % cfg.num_experts, cfg.num_experts)
           * real).sum((0, 1))
          for i in range(layers + cfg.num_mtp_layers)])
    return out, aux
