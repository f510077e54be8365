"""Tests of kda_lm/hf/: Hugging Face checkpoints in and out, against the
golden fixtures of tests/testdata/hf (made by transformers, see its
README)."""

import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import types

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import process_support
import pytest

from data import tokenizer as tokenizer_lib
from kda_lm import config, hf, model, stack
from kda_lm.hf import convert, formats, mapping, safetensors_io
from kda_lm.parallel import sharding
from kda_lm.train import state as state_lib
from testbed import numerics

FIXTURES = os.path.join(process_support.REPO, "tests", "testdata", "hf")
TYPES = ("bailing_hybrid", "kimi_linear")
# Every fixture's model_type: the two formats, Ling with YaRN rope scaling
# and attention biases, Kimi with attention biases, Ling with per-layer
# SwiGLU clamps (which change its logits by 11-27%), and kda-lm's own
# exports of byte-vocabulary models as a run trained here has them
# (loaded by transformers, which recorded their logits).
FIXTURE_TYPES = {"bailing_hybrid": "bailing_hybrid",
                 "kimi_linear": "kimi_linear",
                 "bailing_hybrid_yarn": "bailing_hybrid",
                 "kimi_linear_bias": "kimi_linear",
                 "bailing_hybrid_clamp": "bailing_hybrid",
                 "export_bytes_bailing_hybrid": "bailing_hybrid",
                 "export_bytes_kimi_linear": "kimi_linear",
                 "export_bpe_bailing_hybrid": "bailing_hybrid"}
# kda-lm's exports carry the run's tokenizer, which transformers'
# AutoTokenizer loaded and encoded a text with.
EXPORTS_WITH_TOKENIZERS = ("export_bytes_bailing_hybrid",
                           "export_bytes_kimi_linear",
                           "export_bpe_bailing_hybrid")
GAP = 3   # Padding tokens between documents in the padded row.

# Tiny shapes: compilation dominates (conftest.fast_compile).
pytestmark = pytest.mark.usefixtures("fast_compile")


def fixture(name):
  return os.path.join(FIXTURES, name)


def fixture_config(name):
  """The fixture's parsed `config.json`."""
  with open(os.path.join(fixture(name), "config.json")) as f:
    return json.load(f)


@functools.lru_cache(maxsize=None)
def golden(name):
  """(documents' tokens, HF's logits of each document run alone)."""
  g = np.load(os.path.join(fixture(name), "golden.npz"))
  n = sum(k.startswith("tokens_") for k in g)
  return ([g[f"tokens_{i}"] for i in range(n)],
          [g[f"logits_{i}"] for i in range(n)])


def packed_rows(docs):
  """Two rows: the documents packed back to back, and with GAP padding
  tokens before each (same length T). Returns tokens, ids, starts."""
  T = sum(len(d) for d in docs) + GAP * len(docs)
  tokens = np.zeros((2, T), np.int32)
  ids = np.zeros((2, T), np.int32)
  starts = [[], []]
  for row, gap in ((0, 0), (1, GAP)):
    t = 0
    for i, d in enumerate(docs):
      t += gap
      tokens[row, t:t + len(d)] = d
      ids[row, t:t + len(d)] = i + 1
      starts[row].append(t)
      t += len(d)
  return tokens, ids, starts


@pytest.mark.parametrize("name", FIXTURE_TYPES)
def test_import_gives_hf_logits_in_a_packed_row(name):
  model_config, params = hf.load_pretrained(fixture(name))
  docs, want = golden(name)
  tokens, ids, starts = packed_rows(docs)
  logits = np.asarray(model.build(model_config).apply(
      params, jnp.asarray(tokens), jnp.asarray(ids)))
  for i, d in enumerate(docs):
    for row in (0, 1):   # Packed, and with padding between documents.
      got = logits[row, starts[row][i]:starts[row][i] + len(d)]
      err = numerics.rel_err(got, want[i])
      assert err < 1e-5, (name, row, i, err)


@pytest.mark.parametrize("name", EXPORTS_WITH_TOKENIZERS)
def test_exported_tokenizer_gives_autotokenizers_ids(name):
  """transformers' AutoTokenizer loaded the exported tokenizer and gave the
  ids kda-lm's own codec gives (for bytes: the text's UTF-8 bytes)."""
  g = np.load(os.path.join(fixture(name), "golden.npz"))
  text = bytes(g["tokenizer_text"]).decode()
  codec = tokenizer_lib.TextCodec(
      os.path.join(fixture(name), "tokenizer.json"))
  assert codec.encode(text) == g["tokenizer_ids"].tolist()
  if "bytes" in name:
    assert g["tokenizer_ids"].tolist() == list(text.encode())
  else:
    assert len(g["tokenizer_ids"]) < len(text.encode())
  assert max(g["tokenizer_ids"]) < fixture_config(name)["vocab_size"]


def header(path):
  """{name: (dtype, shape)} of every tensor of a checkpoint directory."""
  out = {}
  for name, shard in safetensors_io.weight_map(path).items():
    entries, _ = safetensors_io.read_header(os.path.join(path, shard))
    out[name] = (entries[name]["dtype"], tuple(entries[name]["shape"]))
  return out


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# The reading and writing logic on the fixtures' tensors, without running
# a model (a few seconds: the mutation session's selection, see
# docs/testing.md).


def test_read_config_names_a_directory_without_one(tmp_path):
  with pytest.raises(ValueError, match=f"^{tmp_path} has no config.json.$"):
    convert.read_config(str(tmp_path))
  assert convert.read_config(fixture("kimi_linear")) == fixture_config(
      "kimi_linear")


def test_check_names_missing_unexpected_and_mtp_tensors(caplog):
  """The first missing or unexpected name (sorted) and their count; the
  tensors of the MTP layers after the last layer skipped, with a
  warning."""
  cfg = types.SimpleNamespace(num_layers=5)
  tmap = {f"model.layers.{i}.w": None for i in range(5)}
  tmap["model.norm.weight"] = None
  with pytest.raises(ValueError, match=re.escape(
      "The checkpoint lacks tensor 'model.layers.1.w' (2 missing).")):
    convert._check_names(tmap, set(tmap) - {"model.layers.1.w",
                                            "model.layers.3.w"}, {}, cfg)
  mtp = {"num_nextn_predict_layers": 2}   # Layers 5 and 6 skipped.
  for extra, first, count in (
      (["model.layers.4.x", "model.layers.50.x"], "model.layers.4.x", 2),
      (["model.layers.7.x", "model.layers.9.x"], "model.layers.7.x", 2),
      (["model.layers.4.x", "model.layers.5.x"], "model.layers.4.x", 1)):
    with pytest.raises(ValueError, match=re.escape(
        f"The checkpoint has an unexpected tensor {first!r} ({count} "
        f"unexpected).")):
      convert._check_names(tmap, set(tmap) | set(extra), mtp, cfg)
  caplog.set_level(logging.WARNING)
  assert convert._check_names(tmap, set(tmap), mtp, cfg) == set()
  assert not caplog.records
  skipped = {"model.layers.5.a", "model.layers.5.b", "model.layers.6.a"}
  assert convert._check_names(tmap, set(tmap) | skipped, mtp, cfg) == (
      skipped)
  assert [r.getMessage() for r in caplog.records] == [
      "Skipping 3 tensors of 2 MTP layers (kda-lm imports the main model "
      "only)."]
  for no_mtp in ({}, {"num_nextn_predict_layers": None}):
    with pytest.raises(ValueError, match="unexpected tensor "
                       "'model.layers.5.a' \\(1 unexpected\\)"):
      convert._check_names(tmap, set(tmap) | {"model.layers.5.a"}, no_mtp,
                           cfg)


def test_placer_puts_arrays_on_the_device_or_the_mesh():
  abstract = {"m": {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)}}
  value = np.arange(8.0, dtype=np.float32).reshape(4, 2)
  placed = convert._placer(abstract, None)("m", "w", value)
  assert isinstance(placed, jax.Array)
  assert placed.sharding == jax.sharding.SingleDeviceSharding(
      jax.devices()[0])
  np.testing.assert_array_equal(placed, value)
  mesh = sharding.make_mesh(config.MeshConfig())
  placed = convert._placer(abstract, mesh)("m", "w", value)
  assert placed.sharding == state_lib.state_shardings(abstract, mesh)["m"][
      "w"]
  np.testing.assert_array_equal(placed, value)


def expected_params(name):
  """The fixture's tensors, each converted by `mapping` alone: experts
  stacked in their slots, the parameters the format lacks zero."""
  path = fixture(name)
  model_type = FIXTURE_TYPES[name]
  cfg = config.ModelConfig.from_config(formats.from_hf(fixture_config(name)))
  abstract = model.abstract_params(cfg)
  out = {m: {n: np.zeros(s.shape, s.dtype) for n, s in names.items()}
         for m, names in abstract.items()}
  tmap = mapping.tensor_map(cfg, model_type)
  filled = set()
  for hf_name, array in safetensors_io.iter_tensors(
      path, safetensors_io.weight_map(path)):
    t = tmap[hf_name]
    value = mapping.to_kda(t, array)
    if t.expert is None:
      out[t.module][t.name] = value.astype(out[t.module][t.name].dtype)
    else:
      out[t.module][t.name][t.expert] = value
    filled.add((t.module, t.name))
  zero = set(mapping.zero_params(cfg, model_type))
  assert filled | zero == {(m, n) for m in out for n in out[m]}
  return cfg, out


@pytest.mark.parametrize("name", ["bailing_hybrid", "kimi_linear"])
def test_import_fills_each_parameter_from_its_tensors(name):
  cfg, want = expected_params(name)
  got_cfg, params = hf.load_pretrained(fixture(name))
  assert got_cfg == cfg and not cfg.scan_layers
  assert not stack.is_scanned(params)
  assert_trees_equal(params, want)
  if name == "kimi_linear":
    assert mapping.zero_params(cfg, "kimi_linear")


def test_import_scanned_layout_and_keyword_options():
  cfg, want = expected_params("kimi_linear")
  mesh = sharding.make_mesh(config.MeshConfig())
  for on_mesh in (None, mesh):
    scan_config, scanned = hf.load_pretrained(
        fixture("kimi_linear"), mesh=on_mesh, scan_layers=True)
    assert scan_config == dataclasses.replace(cfg, scan_layers=True)
    assert stack.is_scanned(scanned)
    assert_trees_equal(scanned, stack.to_scanned(want, scan_config))
    shardings = {x.sharding for x in jax.tree.leaves(scanned)}
    if on_mesh is None:
      assert shardings == {jax.sharding.SingleDeviceSharding(
          jax.devices()[0])}
    else:
      assert all(isinstance(s, jax.sharding.NamedSharding) and
                 s.mesh == mesh for s in shardings), shardings
  with pytest.raises(TypeError):
    hf.load_pretrained(fixture("kimi_linear"), "float32")


def listing(path):
  return sorted(os.listdir(path))


@pytest.mark.parametrize("name", ["bailing_hybrid", "kimi_linear"])
def test_export_replaces_an_earlier_export_without_running(name, tmp_path):
  """Into an existing folder: a sharded export of host arrays, then a
  single file (the shards and the index go, other files stay), its
  config.json's exact text, the fixture's tensors (from the scanned
  layout too)."""
  cfg, params = hf.load_pretrained(fixture(name))
  out = str(tmp_path)
  for keep in ("modelcard.md", "notes.safetensors.txt", "README.md"):
    (tmp_path / keep).write_text("kept")
  # Host (numpy) arrays as well as JAX ones.
  hf.save_pretrained(cfg, jax.device_get(params), out,
                     max_shard_size=20_000)
  shards = listing(out)
  assert safetensors_io.INDEX in shards and len(shards) > 6, shards
  assert header(out) == header(fixture(name))
  source = dict(fixture_config(name), bos_token_id=7, use_cache=False)
  hf.save_pretrained(cfg, params, out, source_config=source)
  assert listing(out) == ["README.md", "config.json", "model.safetensors",
                          "modelcard.md", "notes.safetensors.txt"]
  with open(os.path.join(out, "config.json")) as f:
    text = f.read()
  assert text == json.dumps(formats.to_hf(cfg, FIXTURE_TYPES[name], source),
                            indent=2, sort_keys=True)
  assert json.loads(text)["bos_token_id"] == 7
  assert header(out) == header(fixture(name))
  assert_trees_equal(hf.load_pretrained(out)[1], params)
  if name == "kimi_linear":
    scanned = stack.to_scanned(params, dataclasses.replace(
        cfg, scan_layers=True))
    hf.save_pretrained(cfg, scanned, out, model_type="kimi_linear")
    assert header(out) == header(fixture(name))


def test_export_refuses_params_that_do_not_fit(tmp_path):
  cfg, params = hf.load_pretrained(fixture("bailing_hybrid"))
  out = str(tmp_path)
  norm = "final_norm"
  assert norm in params, sorted(params)
  want = tuple(params[norm]["weight"].shape)
  for shape in ((want[0] - 1,), (want[0] + 1,)):
    bad = {**params, norm: {"weight": np.ones(shape, np.float32)}}
    with pytest.raises(ValueError, match=re.escape(
        f"params do not fit the config at {norm}/weight: expected {want}, "
        f"got {shape}.")):
      hf.save_pretrained(cfg, bad, out)
  missing = {**params, norm: {}}
  with pytest.raises(ValueError, match=re.escape(
      f"params do not fit the config at {norm}/weight: expected {want}, got "
      f"None.")):
    hf.save_pretrained(cfg, missing, out)
  with pytest.raises(ValueError, match="cannot express model.kda_gate = "
                     "'ling'"):
    hf.save_pretrained(cfg, params, out, model_type="kimi_linear")
  with pytest.raises(TypeError):
    hf.save_pretrained(cfg, params, out, "5GB")
  assert not os.listdir(out)


@pytest.mark.parametrize("name", FIXTURE_TYPES)
def test_export_round_trip_is_exact(name, tmp_path):
  model_config, params = hf.load_pretrained(fixture(name))
  single, sharded = str(tmp_path / "single"), str(tmp_path / "sharded")
  hf.save_pretrained(model_config, params, single)
  hf.save_pretrained(model_config, params, sharded, max_shard_size=20_000)
  assert not os.path.exists(os.path.join(single, safetensors_io.INDEX))
  shards = set(safetensors_io.weight_map(sharded).values())
  assert len(shards) > 3, shards
  assert header(single) == header(fixture(name))
  assert header(sharded) == header(fixture(name))
  for path in (single, sharded):
    config2, params2 = hf.load_pretrained(path)
    assert config2 == model_config
    assert_trees_equal(params2, params)
  original = fixture_config(name)
  with open(os.path.join(single, "config.json")) as f:
    exported = json.load(f)
  differ = {k: (v, original[k]) for k, v in exported.items()
            if k in original and original[k] != v}
  assert not differ, differ
  assert exported["model_type"] == FIXTURE_TYPES[name]
  for key in formats.TOKEN_ID_FIELDS:   # explicit nulls without a source
    assert key in exported and exported[key] is None, key
  for key in ("attention_bias", "rope_parameters"):
    assert (key in exported) == (key in original), key


def test_export_refuses_what_the_format_cannot_express(tmp_path):
  model_config, params = hf.load_pretrained(fixture("bailing_hybrid"))
  with_mtp = dataclasses.replace(model_config, num_mtp_layers=1)
  with pytest.raises(ValueError, match="num_mtp_layers"):
    hf.save_pretrained(with_mtp, params, str(tmp_path))
  model_config, params = hf.load_pretrained(fixture("kimi_linear"))
  gate_bias = "layer_0/kda/g_b_proj"
  params[gate_bias]["b"] = params[gate_bias]["b"] + 1.0
  with pytest.raises(ValueError, match="g_b_proj/b is not zero"):
    hf.save_pretrained(model_config, params, str(tmp_path))
  other_v = dataclasses.replace(model_config, kda_head_v_dim=4)
  with pytest.raises(ValueError, match="kda_head_v_dim"):
    hf.save_pretrained(other_v, params, str(tmp_path))


def rewrite(path, edit):
  """Rewrites the checkpoint in `path` with `edit(dict of arrays)`."""
  wmap = safetensors_io.weight_map(path)
  arrays = dict(safetensors_io.iter_tensors(path, wmap))
  os.remove(os.path.join(path, safetensors_io.SINGLE))
  edit(arrays)
  safetensors_io.write(path, iter(arrays.items()))


@pytest.mark.parametrize("edit,match", [
    (lambda a: a.pop("model.layers.2.attention.f_proj.weight"),
     "lacks tensor 'model.layers.2.attention.f_proj.weight'"),
    (lambda a: a.update({"model.layers.1.extra": np.zeros(2, np.float32)}),
     "unexpected tensor 'model.layers.1.extra'"),
    (lambda a: a.update({"model.norm.weight": np.ones(3, np.float32)}),
     r"'model.norm.weight' has shape \(3,\)"),
    (lambda a: a.update({"model.norm.weight": np.ones(40, np.float32)}),
     r"'model.norm.weight' has shape \(40,\); the config gives \(16,\)"),
])
def test_bad_tensors_are_named(tmp_path, edit, match):
  path = str(tmp_path / "ckpt")
  shutil.copytree(fixture("bailing_hybrid"), path)
  rewrite(path, edit)
  with pytest.raises(ValueError, match=match):
    hf.load_pretrained(path)


def test_attention_biases_are_read_in_both_formats():
  """MLA's biases (`attention_bias`, Ling with YaRN and Kimi) reach their
  parameters (the YaRN fields: tests/hf_formats_test.py)."""
  m = formats.from_hf(fixture_config("bailing_hybrid_yarn"))
  assert m.mla_bias
  kimi = formats.from_hf(fixture_config("kimi_linear_bias"))
  assert kimi.mla_bias and kimi.rope_scaling.type == "none"
  _, params = hf.load_pretrained(fixture("bailing_hybrid_yarn"))
  biases = {k: v for k, v in safetensors_io.iter_tensors(
      fixture("bailing_hybrid_yarn"), safetensors_io.weight_map(
          fixture("bailing_hybrid_yarn"))) if k.startswith(
              "model.layers.7.attention.") and k.endswith(".bias")}
  assert len(biases) == 3
  assert model.param_count(config.ModelConfig.from_config(m)) == sum(
      x.size for x in jax.tree.leaves(params))
  for hf_name, module in (("q_a_proj", "q_a_proj"), ("dense", "o_proj"),
                          ("kv_a_proj_with_mqa", "kv_a_proj")):
    np.testing.assert_array_equal(
        params[f"layer_7/mla/{module}"]["b"],
        biases[f"model.layers.7.attention.{hf_name}.bias"])


def test_mesh_placement_and_dtype():
  mesh = sharding.make_mesh(config.MeshConfig())
  model_config, params = hf.load_pretrained(fixture("kimi_linear"),
                                            dtype="bfloat16", mesh=mesh)
  assert model_config.param_dtype == "bfloat16"
  for module, name, p in hk.data_structures.traverse(params):
    assert isinstance(p.sharding, jax.sharding.NamedSharding), module
    assert p.sharding.mesh == mesh
    f32 = name in ("A_log", "dt_bias", "router", "e_score_correction_bias")
    assert p.dtype == (jnp.float32 if f32 else jnp.bfloat16), (module, name)


def test_format_options_reach_the_layers():
  """`mla_norm_eps`, `kda_lower_bound` and `moe_renormalize` change the
  logits."""
  model_config, _ = hf.load_pretrained(fixture("bailing_hybrid"))
  model_config = dataclasses.replace(model_config, attention_pattern="KM")
  tokens = jnp.asarray(golden("bailing_hybrid")[0][1])[None]
  params = model.build(model_config).init(jax.random.key(0), tokens)
  base = model.build(model_config).apply(params, tokens)
  for key, value in (("mla_norm_eps", 1.0), ("kda_lower_bound", -1.0),
                     ("moe_renormalize", False)):
    changed = dataclasses.replace(model_config, **{key: value})
    other = model.build(changed).apply(params, tokens)
    assert numerics.rel_err(other, base) > 1e-3, key


def test_kimi_dense_layers_saved_as_mlp(tmp_path):
  path = str(tmp_path / "ckpt")
  shutil.copytree(fixture("kimi_linear"), path)

  def rename(arrays):
    for name in [k for k in arrays if ".0.block_sparse_moe." in k]:
      arrays[name.replace("block_sparse_moe", "mlp")] = arrays.pop(name)

  rewrite(path, rename)
  assert any(".0.mlp." in k for k in safetensors_io.weight_map(path))
  _, want = hf.load_pretrained(fixture("kimi_linear"))
  _, got = hf.load_pretrained(path)
  assert_trees_equal(got, want)


def test_mtp_layers_are_skipped_and_kimi_ignores_rope_scaling(tmp_path):
  path = str(tmp_path / "ckpt")
  shutil.copytree(fixture("bailing_hybrid"), path)
  rewrite(path, lambda a: a.update(
      {"model.layers.8.enorm.weight": np.ones(16, np.float32)}))
  with pytest.raises(ValueError, match="unexpected tensor 'model.layers.8"):
    hf.load_pretrained(path)
  with open(os.path.join(path, "config.json")) as f:
    hf_config = json.load(f)
  hf_config["num_nextn_predict_layers"] = 1
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config, f)
  _, params = hf.load_pretrained(path)
  _, want = hf.load_pretrained(fixture("bailing_hybrid"))
  assert_trees_equal(params, want)
  with open(os.path.join(fixture("kimi_linear"), "config.json")) as f:
    kimi = json.load(f)
  kimi["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
  assert formats.from_hf(kimi).use_nope


@pytest.mark.parametrize("model_type", TYPES)
def test_scanned_layout_imports_and_exports(model_type, tmp_path):
  model_config, params = hf.load_pretrained(fixture(model_type))
  scan_config, scanned = hf.load_pretrained(fixture(model_type),
                                            scan_layers=True)
  assert scan_config.scan_layers and stack.is_scanned(scanned)
  assert_trees_equal(stack.to_unscanned(scanned, scan_config), params)
  docs, want = golden(model_type)
  tokens, ids, starts = packed_rows(docs)
  logits = np.asarray(model.build(scan_config).apply(
      scanned, jnp.asarray(tokens), jnp.asarray(ids)))
  for i, d in enumerate(docs):
    got = logits[0, starts[0][i]:starts[0][i] + len(d)]
    assert numerics.rel_err(got, want[i]) < 1e-5
  hf.save_pretrained(scan_config, scanned, str(tmp_path))
  assert header(str(tmp_path)) == header(fixture(model_type))
  assert_trees_equal(hf.load_pretrained(str(tmp_path))[1], params)
