"""`load_pretrained` and `save_pretrained`: a Hugging Face checkpoint
directory <-> (kda-lm's typed model config, its parameter tree).

Loading streams: tensors are read one at a time, shard by shard, each
converted to kda-lm's layout and cast to its parameter's dtype at once (on
a mesh, placed with its training sharding), so the host holds at most one
tensor being read plus the output tree (a stacked routed-expert array is
assembled on the host, then placed).
"""

import dataclasses
import json
import os
from typing import Any, Optional, Union

from absl import logging
import haiku as hk
import jax
import numpy as np

from kda_lm import config as config_lib
from kda_lm import model as model_lib
from kda_lm import stack
from kda_lm.hf import formats, mapping, safetensors_io
from kda_lm.train import state as state_lib

CONFIG = "config.json"


def read_config(hf_dir: str) -> dict:
  """The parsed `config.json` of `hf_dir`."""
  path = os.path.join(hf_dir, CONFIG)
  if not os.path.exists(path):
    raise ValueError(f"{hf_dir} has no {CONFIG}.")
  with open(path) as f:
    return json.load(f)


def _check_names(tmap: dict, names: set, hf: dict, cfg) -> set:
  """Raises for missing or unexpected tensors; returns names to skip
  (the MTP layers HF ignores too)."""
  missing = sorted(set(tmap) - names)
  if missing:
    raise ValueError(f"The checkpoint lacks tensor {missing[0]!r} "
                     f"({len(missing)} missing).")
  extra = sorted(names - set(tmap))
  n = cfg.num_layers
  n_mtp = int(hf.get("num_nextn_predict_layers") or 0)
  mtp = {x for x in extra if any(x.startswith(f"model.layers.{n + k}.")
                                 for k in range(n_mtp))}
  unexpected = sorted(set(extra) - mtp)
  if unexpected:
    raise ValueError(f"The checkpoint has an unexpected tensor "
                     f"{unexpected[0]!r} ({len(unexpected)} unexpected).")
  if mtp:
    logging.warning("Skipping %d tensors of %d MTP layers (kda-lm imports "
                    "the main model only).", len(mtp), n_mtp)
  return mtp


def _placer(abstract: Any, mesh: Optional[jax.sharding.Mesh]):
  """`place(module, name, array)`: a numpy array to a jax array."""
  if mesh is None:
    return lambda module, name, array: jax.device_put(array)
  shardings = state_lib.state_shardings(abstract, mesh)
  return lambda module, name, array: jax.device_put(
      array, shardings[module][name])


def load_pretrained(path: str, *, dtype: Optional[str] = None,
                    mesh: Optional[jax.sharding.Mesh] = None,
                    scan_layers: bool = False
                    ) -> tuple[config_lib.ModelConfig, hk.Params]:
  """Reads a `bailing_hybrid` or `kimi_linear` checkpoint directory.

  Args:
    path: a directory with `config.json` and `model.safetensors` (or shards
      with `model.safetensors.index.json`).
    dtype: the parameters' dtype ("float32", "bfloat16", "float16"); None
      = the checkpoint's. Decay parameters and routers stay float32.
    mesh: place each tensor with its training sharding on this mesh
      (`kda_lm.parallel.sharding`); None = the default device.
    scan_layers: return the scanned layout (`kda_lm.stack`) and a config
      with `scan_layers` on; the tensors are then stacked on the host and
      placed once stacked (the host holds the whole tree for a moment).

  Returns:
    (the model's `ModelConfig`, read here from `config.json`, the
    parameter tree): `kda_lm.model.build(model_config).apply(params,
    tokens, segment_ids)` gives the logits.

  Raises:
    ValueError: an unsupported format or field, a missing, unexpected or
      misshapen tensor (the message names it).
  """
  hf = read_config(path)
  model_type = formats.model_type_of(hf)
  cfg = config_lib.ModelConfig.from_config(
      formats.from_hf(hf, dtype=dtype))
  if scan_layers:
    _, params = load_pretrained(path, dtype=dtype, mesh=None,
                                scan_layers=False)
    cfg = dataclasses.replace(cfg, scan_layers=True)
    params = stack.to_scanned(jax.device_get(params), cfg)
    if mesh is None:
      return cfg, jax.device_put(params)
    return cfg, jax.device_put(params, state_lib.state_shardings(
        model_lib.abstract_params(cfg), mesh))
  abstract = model_lib.abstract_params(cfg)
  tmap = mapping.tensor_map(cfg, model_type)
  wmap = safetensors_io.weight_map(path)
  names = {mapping.canonical_name(k, model_type): k for k in wmap}
  skip = _check_names(tmap, set(names), hf, cfg)
  place = _placer(abstract, mesh)
  params, pending = {}, {}
  for name, array in safetensors_io.iter_tensors(
      path, {k: v for k, v in wmap.items()
             if mapping.canonical_name(k, model_type) not in skip}):
    t = tmap[mapping.canonical_name(name, model_type)]
    spec = abstract[t.module][t.name]
    want = mapping.hf_shape(t, tuple(spec.shape), model_type)
    if tuple(array.shape) != want:
      raise ValueError(f"Tensor {name!r} has shape {tuple(array.shape)}; "
                       f"the config gives {want}.")
    value = mapping.to_kda(t, array).astype(spec.dtype)
    out = params.setdefault(t.module, {})
    if t.expert is None:
      out[t.name] = place(t.module, t.name, value)
      continue
    buf, left = pending.get((t.module, t.name), (None, spec.shape[0]))
    if buf is None:
      buf = np.empty(spec.shape, spec.dtype)
    buf[t.expert] = value
    pending[(t.module, t.name)] = (buf, left - 1)
    if left == 1:
      out[t.name] = place(t.module, t.name, buf)
      del pending[(t.module, t.name)]
  for module, name in mapping.zero_params(cfg, model_type):
    spec = abstract[module][name]
    params.setdefault(module, {})[name] = place(
        module, name, np.zeros(spec.shape, spec.dtype))
  return cfg, params


def _hf_tensors(cfg, params, model_type, tmap):
  """(name, numpy array) in HF's layout, in checkpoint order."""
  for name, t in tmap.items():
    value = np.asarray(jax.device_get(params[t.module][t.name]))
    yield name, mapping.to_hf(t, value, model_type)


def save_pretrained(model_config: config_lib.ModelConfig, params: hk.Params,
                    path: str, *,
                    max_shard_size: Union[int, str] = "5GB",
                    model_type: Optional[str] = None,
                    source_config: Optional[dict] = None) -> None:
  """Writes the checkpoint directory `transformers` reads.

  Args:
    model_config: the model's settings, typed (`load_pretrained`'s, a
      run's `RunConfig.model`).
    params: its parameter tree (either layout, `kda_lm.stack`).
    path: the output directory (created).
    max_shard_size: bytes per shard ("5GB", "200MB", an int); more than one
      shard adds `model.safetensors.index.json`.
    model_type: "bailing_hybrid" or "kimi_linear"; None = by the KDA gate
      form (`ling` or `kimi`).
    source_config: the `config.json` the model was imported from, if any
      (its token ids and other fields kda-lm ignores are kept:
      `formats.carried_fields`).

  Raises:
    ValueError: the format cannot express the config (names the option),
      a parameter it lacks is not zero, or `params` does not fit the config.
  """
  if stack.is_scanned(params):
    params = stack.to_unscanned(params, model_config)
  cfg = dataclasses.replace(model_config, scan_layers=False)
  model_type = model_type or formats.guess_model_type(cfg)
  hf = formats.to_hf(cfg, model_type, source_config)
  tmap = mapping.tensor_map(cfg, model_type)
  abstract = model_lib.abstract_params(cfg)
  for module, names in abstract.items():
    for name, spec in names.items():
      got = params.get(module, {}).get(name)
      if got is None or tuple(got.shape) != tuple(spec.shape):
        raise ValueError(f"params do not fit the config at {module}/{name}: "
                         f"expected {tuple(spec.shape)}, got "
                         f"{None if got is None else tuple(got.shape)}.")
  for module, name in mapping.zero_params(cfg, model_type):
    if np.any(np.asarray(jax.device_get(params[module][name]))):
      raise ValueError(f"{module}/{name} is not zero, and the {model_type} "
                       f"format has no such parameter; it cannot be "
                       f"exported.")
  os.makedirs(path, exist_ok=True)
  for old in os.listdir(path):   # A previous export's files.
    if old.startswith("model") and ".safetensors" in old:
      os.remove(os.path.join(path, old))
  with open(os.path.join(path, CONFIG), "w") as f:
    json.dump(hf, f, indent=2, sort_keys=True)
  safetensors_io.write(path, _hf_tensors(cfg, params, model_type, tmap),
                       max_shard_size)
