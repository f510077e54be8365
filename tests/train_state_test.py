"""Tests of the run config check (`kda_lm.config.check_config`) and of the
train state's initialisation (`kda_lm.train.state`)."""

import chex
import helpers
import jax
import numpy as np
import pytest

from configs import ling3_tiny
from data import pipeline
from kda_lm import config as config_lib
from kda_lm import model as model_lib
from kda_lm import optimizer
from kda_lm.parallel import sharding
from kda_lm.train import loop as train_loop
from kda_lm.train import state

tiny_config = helpers.tiny_train_config

# Tiny shapes: compilation dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")


def test_unknown_and_bad_config_keys(data_dir):
  config = tiny_config(data_dir)
  config_lib.check_config(config)
  config.train.stepz = 3
  with pytest.raises(ValueError, match=r"config\.train\.stepz"):
    config_lib.check_config(config)
  config = tiny_config(data_dir)
  config.extra = {"a": 1}
  with pytest.raises(ValueError, match=r"config\.extra"):
    config_lib.check_config(config)
  config = tiny_config(data_dir)
  config.model.num_layerz = 3
  with pytest.raises(ValueError, match=r"config\.model\.num_layerz"):
    config_lib.check_config(config)
  config = tiny_config(data_dir)
  del config.opt["peak_lr"]
  with pytest.raises(ValueError, match="peak_lr"):
    config_lib.check_config(config)
  # Byte-level data (256 ids) for a model with 16 ids.
  config = tiny_config(data_dir)
  config.data.name = "text_files"
  with pytest.raises(ValueError, match="256 token ids") as e:
    config_lib.check_config(config)
  # The message names the fix; the fix works.
  assert "--config.model.vocab_size=256" in str(e.value)
  config.model.vocab_size = 256
  config_lib.check_config(config)
  # A locked config (as train.py's --config.* overrides) rejects new keys.
  config = tiny_config(data_dir)
  config.lock()
  with pytest.raises(AttributeError):
    config.train.stepz = 3


@pytest.mark.parametrize("variant,pattern,dataset,vocab", [
    ("", "KKKM", "delayed_copy", 32), ("text", "KKKM", "text_files", 4096),
    ("text_bytes", "KKKM", "text_files", 256),
    ("kda_only", "KKKK", "delayed_copy", 32),
    ("mla_only", "MMMM", "delayed_copy", 32),
    ("text,kda_only", "KKKK", "text_files", 4096)])
def test_config_variants(variant, pattern, dataset, vocab):
  config = ling3_tiny.get_config(variant)
  config_lib.check_config(config)
  assert config.model.attention_pattern == pattern
  assert config.data.name == dataset
  assert config.model.vocab_size == pipeline.vocab_size(config.data) == vocab
  # Text rows come from shuffled pieces; delayed copy keeps its stream.
  assert config.data.piece_shuffle_buffer == (1024 if "text" in variant
                                              else 0)
  # The default delay is beyond the short-conv receptive field of the model.
  assert config.data.delay > len(pattern) * (config.model.conv_size - 1)
  with pytest.raises(ValueError, match="variant"):
    ling3_tiny.get_config("large")
  with pytest.raises(ValueError, match="one of"):
    ling3_tiny.get_config("text,text_bytes")


def test_bad_expert_axis_refused_before_tracing(data_dir):
  """`config.mesh.expert` that the routed experts do not divide, or on a
  dense model: a ValueError from the config check, naming the fields."""
  config = tiny_config(data_dir)
  config.mesh.expert = 4
  assert config_lib.check_config(config).mesh.expert == 4
  config.mesh.expert = 3
  with pytest.raises(ValueError, match=r"config\.model\.num_experts = 8 is "
                     r"not a multiple of config\.mesh\.expert = 3"):
    config_lib.check_config(config)
  config.mesh.expert = 2
  config.model.num_experts = 0
  with pytest.raises(ValueError, match=r"config\.mesh\.expert = 2 shards "
                     r"routed experts, but the model has none"):
    config_lib.check_config(config)


def test_init_rng_draws_the_parameters_and_nothing_else(data_dir):
  run = config_lib.check_config(
      tiny_config(data_dir, train__init_rng="unsafe_rbg"))
  mesh = sharding.make_mesh(run.mesh)
  steps = train_loop.build_steps(run, mesh)
  rbg = steps.init(steps.rng)
  m = model_lib.build(run.model)
  tx, _ = optimizer.make_optimizer(run.opt, run.train.num_steps)
  threefry = jax.jit(state.make_init_fn(m, tx, run.data.seq_len,
                                        "threefry"))(steps.rng)
  # "auto", the default, is threefry on the CPU.
  auto = jax.jit(state.make_init_fn(m, tx, run.data.seq_len))(steps.rng)
  chex.assert_trees_all_equal(jax.device_get(auto), jax.device_get(threefry))
  again = jax.jit(state.make_init_fn(m, tx, run.data.seq_len,
                                     "unsafe_rbg"))(steps.rng)
  # The run's init uses the config's generator, the same values each time.
  chex.assert_trees_all_equal(jax.device_get(rbg.params),
                              jax.device_get(again.params))
  chex.assert_trees_all_equal_shapes_and_dtypes(rbg, threefry)
  # Random initialisers draw other values; constant ones (norm scales,
  # zero biases) and the state's own rng do not change.
  same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)),
                      rbg.params, threefry.params)
  assert not same["embed"]["embeddings"]
  assert any(jax.tree.leaves(same)) and not all(jax.tree.leaves(same))
  np.testing.assert_array_equal(rbg.rng, threefry.rng)
  # Given parameters (an imported checkpoint's), the state's rng is split
  # from the key as a fresh run's is, and the parameters are kept.
  given = jax.jit(steps.init)(steps.rng, threefry.params)
  np.testing.assert_array_equal(given.rng, rbg.rng)
  chex.assert_trees_all_equal(given.params, threefry.params)
  # A typed key gives the same parameters as its raw bits.
  typed = jax.jit(state.make_init_fn(m, tx, run.data.seq_len, "unsafe_rbg"))(
      jax.random.wrap_key_data(steps.rng))
  chex.assert_trees_all_equal(typed.params, again.params)
  with pytest.raises(ValueError, match="init_rng must be one of"):
    config_lib.TrainConfig(init_rng="philox")


def test_auto_init_rng_is_unsafe_rbg_on_accelerators_only():
  assert config_lib.TrainConfig().init_rng == "auto"
  assert [state.init_rng_impl("auto", p) for p in ("tpu", "gpu", "cpu")] == [
      "unsafe_rbg", "unsafe_rbg", "threefry"]
  assert state.init_rng_impl("auto") == "threefry"   # This CPU backend.
  for choice in ("threefry", "unsafe_rbg"):
    assert state.init_rng_impl(choice, "tpu") == choice
