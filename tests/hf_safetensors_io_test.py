"""Tests of kda_lm/hf/safetensors_io.py: the format, bfloat16, shards."""

import json
import os

import ml_dtypes
import numpy as np
import pytest

from kda_lm import testing
from kda_lm.hf import safetensors_io

FIXTURE = os.path.join(testing.REPO, "tests", "testdata", "hf",
                       "kimi_linear")


def test_round_trip_of_every_dtype_and_shards(tmp_path):
  rng = np.random.default_rng(0)
  tensors = {
      "a": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
      "b": rng.standard_normal((7,)).astype(np.float32),
      "c": rng.standard_normal((2, 2, 2)).astype(np.float16),
      "d": np.arange(6, dtype=np.int64).reshape(2, 3),
      "e": np.zeros((0, 4), np.float32),
  }
  files = safetensors_io.write(str(tmp_path), iter(tensors.items()),
                               max_shard_size=40)
  assert safetensors_io.INDEX in files and len(files) > 3
  wmap = safetensors_io.weight_map(str(tmp_path))
  got = dict(safetensors_io.iter_tensors(str(tmp_path), wmap))
  assert set(got) == set(tensors)
  for name, want in tensors.items():
    assert got[name].dtype == want.dtype and got[name].shape == want.shape
    np.testing.assert_array_equal(got[name], want)
  with open(os.path.join(tmp_path, safetensors_io.INDEX)) as f:
    index = json.load(f)
  assert index["metadata"]["total_size"] == sum(
      t.nbytes for t in tensors.values())


def test_rewriting_the_fixture_is_byte_identical(tmp_path):
  """The writer's file is transformers' own, byte for byte, up to the
  header (field order and padding): the data section is identical."""
  path = os.path.join(FIXTURE, safetensors_io.SINGLE)
  wmap = safetensors_io.weight_map(FIXTURE)
  header, start = safetensors_io.read_header(path)
  order = sorted(wmap, key=lambda k: header[k]["data_offsets"][0])
  arrays = dict(safetensors_io.iter_tensors(FIXTURE, wmap))
  safetensors_io.write(str(tmp_path), ((k, arrays[k]) for k in order))
  out = os.path.join(tmp_path, safetensors_io.SINGLE)
  _, out_start = safetensors_io.read_header(out)
  with open(path, "rb") as a, open(out, "rb") as b:
    assert a.read()[start:] == b.read()[out_start:]


@pytest.mark.parametrize("size,want", [
    ("5GB", 5 * 10**9), ("200KiB", 200 * 2**10), ("1000", 1000),
    (123, 123), ("1.5MB", 1_500_000)])
def test_parse_size(size, want):
  assert safetensors_io.parse_size(size) == want


def test_bad_files_are_named(tmp_path):
  with pytest.raises(ValueError, match="neither"):
    safetensors_io.weight_map(str(tmp_path))
  with open(os.path.join(tmp_path, safetensors_io.INDEX), "w") as f:
    json.dump({"weight_map": {"x": "model-00001-of-00002.safetensors"}}, f)
  with pytest.raises(ValueError, match="model-00001-of-00002"):
    safetensors_io.weight_map(str(tmp_path))
  with pytest.raises(ValueError, match="max_shard_size"):
    safetensors_io.parse_size("5 parsecs")
