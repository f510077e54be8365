"""Tests of kda_lm/hf/mapping.py: the tensor names and layouts, against the
fixtures' headers (written by transformers, tests/testdata/hf) and the
parameter shapes of their configs, without running a model."""

import dataclasses
import functools
import json
import os

import numpy as np
import process_support
import pytest

from kda_lm import config, model
from kda_lm.hf import formats, mapping, safetensors_io

FIXTURES = os.path.join(process_support.REPO, "tests", "testdata", "hf")
# Fixture -> model_type: both formats, MLA with and without a query latent
# (Ling's fixtures have one, Kimi's and the exports do not), with and
# without attention biases.
FIXTURE_TYPES = {"bailing_hybrid": mapping.BAILING,
                 "bailing_hybrid_yarn": mapping.BAILING,
                 "kimi_linear": mapping.KIMI,
                 "kimi_linear_bias": mapping.KIMI,
                 "export_bytes_bailing_hybrid": mapping.BAILING}


def fixture(name):
  return os.path.join(FIXTURES, name)


def fixture_type(name):
  """The fixture's `model_type` as its `config.json` spells it: a string
  read from JSON, not the module's constant (`is` tells them apart)."""
  with open(os.path.join(fixture(name), "config.json")) as f:
    model_type = json.load(f)["model_type"]
  assert model_type == FIXTURE_TYPES[name]
  return model_type


@functools.lru_cache(maxsize=None)
def fixture_config(name):
  """The fixture's typed `ModelConfig`."""
  with open(os.path.join(fixture(name), "config.json")) as f:
    return config.ModelConfig.from_config(formats.from_hf(json.load(f)))


@functools.lru_cache(maxsize=None)
def abstract(cfg):
  """{module: {name: shape}} of the config's (unscanned) parameters."""
  return {module: {name: tuple(spec.shape) for name, spec in names.items()}
          for module, names in model.abstract_params(cfg).items()}


def header_shapes(name):
  """{tensor name: shape} in the order of the fixture's header."""
  path = fixture(name)
  out = {}
  for tensor, shard in safetensors_io.weight_map(path).items():
    entries, _ = safetensors_io.read_header(os.path.join(path, shard))
    out[tensor] = tuple(entries[tensor]["shape"])
  return out


def assert_covers_the_tree(cfg, model_type, tmap):
  """Every parameter is filled exactly once: by one tensor, by one tensor
  per expert slot of a stacked array, or as a zero parameter."""
  shapes = abstract(cfg)
  filled = {}
  for t in tmap.values():
    filled.setdefault((t.module, t.name), []).append(t.expert)
  for module, name in mapping.zero_params(cfg, model_type):
    assert (module, name) not in filled, (module, name)
    filled[(module, name)] = [None]
  want = {(m, n) for m, names in shapes.items() for n in names}
  assert set(filled) == want, set(filled) ^ want
  for (module, name), experts in filled.items():
    if experts == [None]:
      continue
    assert experts == list(range(shapes[module][name][0])), (module, name)


@pytest.mark.parametrize("name", FIXTURE_TYPES)
def test_tensor_map_names_and_shapes_every_fixture_tensor(name):
  """The map's names are the header's (transformers' spelling), in
  checkpoint order, with the shapes the parameters give; every parameter
  is filled once."""
  model_type = fixture_type(name)
  cfg = fixture_config(name)
  tmap = mapping.tensor_map(cfg, model_type)
  header = header_shapes(name)
  assert set(tmap) == set(header), set(tmap) ^ set(header)
  shapes = abstract(cfg)
  for tensor, t in tmap.items():
    assert mapping.hf_shape(t, shapes[t.module][t.name],
                            model_type) == header[tensor], tensor
  assert_covers_the_tree(cfg, model_type, tmap)
  names = list(tmap)
  assert names[0].endswith("embed_tokens.weight") or names[0].endswith(
      "word_embeddings.weight")
  assert names[-2:] == ["model.norm.weight", "lm_head.weight"]
  layers = [int(n.split(".")[2]) for n in names[1:-2]]
  assert layers == sorted(layers) and layers[-1] == cfg.num_layers - 1


@pytest.mark.parametrize("name", FIXTURE_TYPES)
def test_fixture_tensors_round_trip_through_kda_layout(name):
  """Each tensor read into kda-lm's layout has its parameter's shape (one
  slot of a stacked expert array) and comes back identical."""
  model_type = fixture_type(name)
  cfg = fixture_config(name)
  tmap = mapping.tensor_map(cfg, model_type)
  shapes = abstract(cfg)
  path = fixture(name)
  arrays = dict(safetensors_io.iter_tensors(
      path, safetensors_io.weight_map(path)))
  params = {}
  for tensor, t in tmap.items():
    value = mapping.to_kda(t, arrays[tensor])
    shape = shapes[t.module][t.name]
    if t.expert is None:
      assert value.shape == shape, tensor
      params.setdefault(t.module, {})[t.name] = value
    else:
      assert value.shape == shape[1:], tensor
      stacked = params.setdefault(t.module, {}).setdefault(
          t.name, np.zeros(shape, value.dtype))
      stacked[t.expert] = value
  for tensor, t in tmap.items():
    back = mapping.to_hf(t, params[t.module][t.name], model_type)
    assert back.flags.c_contiguous, tensor
    np.testing.assert_array_equal(back, arrays[tensor], err_msg=tensor)


@pytest.mark.parametrize("model_type", mapping.MODEL_TYPES)
@pytest.mark.parametrize("change", [
    dict(num_shared_experts=0), dict(first_k_dense_replace=0),
    dict(mla_bias=True, q_lora_rank=0), dict(attention_pattern="MKKM")])
def test_tensor_map_covers_other_configs(model_type, change):
  """Without shared experts, without a dense layer, biased MLA without a
  query latent, MLA layers first: still every parameter once, and no
  tensor for what the config lacks."""
  name = "bailing_hybrid" if model_type == mapping.BAILING else "kimi_linear"
  cfg = dataclasses.replace(fixture_config(name), **change)
  tmap = mapping.tensor_map(cfg, model_type)
  assert_covers_the_tree(cfg, model_type, tmap)
  if change.get("num_shared_experts") == 0:
    assert not any("shared_experts" in n for n in tmap)


def test_unknown_model_type_is_refused():
  with pytest.raises(ValueError, match="Unknown model_type 'llama'"):
    mapping.tensor_map(fixture_config("bailing_hybrid"), "llama")


def test_zero_params_are_kimis_kda_gate_biases():
  cfg = dataclasses.replace(fixture_config("kimi_linear"),
                            attention_pattern="KMKKM")
  assert mapping.zero_params(cfg, mapping.KIMI) == [
      (f"layer_{i}/kda/g_b_proj", "b") for i in (0, 2, 3)]
  assert mapping.zero_params(cfg, mapping.BAILING) == []


def test_canonical_name_reads_kimis_mlp_spelling():
  kimi, ling = fixture_type("kimi_linear"), fixture_type("bailing_hybrid")
  dense = "model.layers.0.mlp.gate_proj.weight"
  assert mapping.canonical_name(dense, kimi) == (
      "model.layers.0.block_sparse_moe.gate_proj.weight")
  assert mapping.canonical_name(dense, ling) == dense
  other = "model.layers.0.self_attn.q_proj.weight"
  assert mapping.canonical_name(other, kimi) == other


def test_layouts_move_each_element_where_the_formats_keep_it():
  """HF linear [out, in] is kda-lm's [in, out]; HF conv [C, 1, J] is
  kda-lm's [J, C] with the same tap order; `A_log` is [H] (Ling) or
  [1, 1, H, 1] (Kimi); `same` is untouched. Stacked experts give their
  slot."""
  linear = np.arange(6.0).reshape(2, 3)   # HF [F=2, D=3]
  t = mapping.Target("m", "w", "transpose")
  np.testing.assert_array_equal(mapping.to_kda(t, linear), linear.T)
  np.testing.assert_array_equal(
      mapping.to_hf(t, linear.T, mapping.BAILING), linear)
  assert mapping.hf_shape(t, (3, 2), mapping.KIMI) == (2, 3)

  conv = np.arange(12.0).reshape(3, 1, 4)   # HF [C=3, 1, J=4]
  t = mapping.Target("m", "weight", "conv")
  kda = mapping.to_kda(t, conv)
  assert kda.shape == (4, 3)
  for c in range(3):
    for j in range(4):
      assert kda[j, c] == conv[c, 0, j]
  np.testing.assert_array_equal(mapping.to_hf(t, kda, mapping.KIMI), conv)
  assert mapping.hf_shape(t, (4, 3), mapping.BAILING) == (3, 1, 4)

  t = mapping.Target("m", "A_log", "a_log")
  a_log = np.arange(3.0)
  kimi = a_log.reshape(1, 1, 3, 1)
  np.testing.assert_array_equal(mapping.to_kda(t, kimi), a_log)
  np.testing.assert_array_equal(mapping.to_kda(t, a_log), a_log)
  assert mapping.to_hf(t, a_log, mapping.KIMI).shape == (1, 1, 3, 1)
  np.testing.assert_array_equal(mapping.to_hf(t, a_log, mapping.KIMI), kimi)
  np.testing.assert_array_equal(mapping.to_hf(t, a_log, mapping.BAILING),
                                a_log)
  assert mapping.hf_shape(t, (3,), mapping.KIMI) == (1, 1, 3, 1)
  assert mapping.hf_shape(t, (3,), mapping.BAILING) == (3,)

  t = mapping.Target("m", "weight", "same")
  norm = np.arange(4.0).reshape(2, 2)
  np.testing.assert_array_equal(mapping.to_kda(t, norm), norm)
  np.testing.assert_array_equal(mapping.to_hf(t, norm, mapping.KIMI), norm)
  assert mapping.hf_shape(t, (2, 2), mapping.KIMI) == (2, 2)

  experts = np.arange(24.0).reshape(2, 3, 4)   # kda-lm [E, D, F]
  for e in range(2):
    t = mapping.Target("m", "gate_proj", "transpose", e)
    np.testing.assert_array_equal(
        mapping.to_hf(t, experts, mapping.BAILING), experts[e].T)
    assert mapping.hf_shape(t, (2, 3, 4), mapping.BAILING) == (4, 3)
