"""Tests of kda_lm/hf/safetensors_io.py: the format, bfloat16, shards."""

import json
import os

import ml_dtypes
import numpy as np
import process_support
import pytest

from kda_lm.hf import safetensors_io

FIXTURE = os.path.join(process_support.REPO, "tests", "testdata", "hf",
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
    (123, 123), ("1.5MB", 1_500_000), ("3MiB", 3 * 2**20),
    ("2GiB", 2 * 2**30), ("7KB", 7000), ("9B", 9)])
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


@pytest.mark.parametrize("content,message", [
    (b"", "too short"), (b"\x05\x00\x00", "too short"),
    ((7).to_bytes(8, "little") + b"{nope}!", "malformed safetensors header"),
])
def test_a_file_that_is_not_safetensors_is_named(tmp_path, content, message):
  path = tmp_path / safetensors_io.SINGLE
  path.write_bytes(content)
  with pytest.raises(ValueError, match=f"model.safetensors .*{message}"):
    safetensors_io.weight_map(str(tmp_path))


@pytest.mark.parametrize("end", [12, 20])
def test_a_tensor_whose_bytes_disagree_with_its_shape_is_named(tmp_path,
                                                               end):
  """A [4] float32 tensor holds 16 bytes: a header giving it fewer or
  more is refused, not read short or past its neighbour."""
  header = json.dumps({"w": {"dtype": "F32", "shape": [4],
                             "data_offsets": [0, end]}}).encode()
  (tmp_path / safetensors_io.SINGLE).write_bytes(
      len(header).to_bytes(8, "little") + header + bytes(end))
  wmap = safetensors_io.weight_map(str(tmp_path))
  with pytest.raises(ValueError, match="'w' in model.safetensors: its data "
                     "size does not match"):
    list(safetensors_io.iter_tensors(str(tmp_path), wmap))


def test_shards_are_numbered_from_1_and_aligned(tmp_path):
  """`model-0000k-of-0000n.safetensors` for k = 1..n, as transformers
  names them, and every file's data starts on an 8-byte boundary (the
  header padded with spaces, as the format asks)."""
  tensors = [(f"t{i}", np.full(i + 1, i, np.float32)) for i in range(3)]
  files = safetensors_io.write(str(tmp_path), iter(tensors),
                               max_shard_size=8)
  assert files == [f"model-0000{k}-of-00003.safetensors"
                   for k in (1, 2, 3)] + [safetensors_io.INDEX]
  for name in files[:-1]:
    _, start = safetensors_io.read_header(str(tmp_path / name))
    assert start % 8 == 0, (name, start)


def test_shards_respect_max_shard_size_and_fill_up(tmp_path):
  """Every shard holds at most `max_shard_size` bytes of tensors, unless it
  holds one larger tensor alone; shards fill greedily (the next shard's
  first tensor did not fit), with a shard of exactly the limit kept
  whole (40 + 60 = 100 bytes)."""
  sizes = [40, 60, 24, 120, 8, 8, 8, 80, 12, 100, 4]   # bytes, float32
  tensors = [(f"t{i:02d}", np.full(n // 4, i, np.float32))
             for i, n in enumerate(sizes)]
  files = safetensors_io.write(str(tmp_path), iter(tensors),
                               max_shard_size=100)
  shards = sorted(f for f in files if f != safetensors_io.INDEX)
  held = []
  for name in shards:
    header, _ = safetensors_io.read_header(os.path.join(tmp_path, name))
    held.append(sorted((k, v["data_offsets"][1] - v["data_offsets"][0])
                       for k, v in header.items() if k != "__metadata__"))
  for shard in held:
    total = sum(n for _, n in shard)
    assert total <= 100 or len(shard) == 1, shard
  for shard, following in zip(held, held[1:], strict=False):
    assert sum(n for _, n in shard) + following[0][1] > 100, (shard,
                                                             following)
  assert held[0] == [("t00", 40), ("t01", 60)]
  assert [k for shard in held for k, _ in shard] == [k for k, _ in tensors]


def test_a_shard_never_exceeds_the_limit_by_one_byte(tmp_path):
  """60 + 41 bytes do not fit a 100-byte shard; 60 + 40 do: in the first
  shard and in a later one."""
  for sizes, shards in (((60, 41), 2), ((60, 40), 1),
                        ((100, 60, 41), 3), ((100, 60, 40), 2)):
    folder = tmp_path / "-".join(map(str, sizes))
    folder.mkdir()
    tensors = [(f"t{i}", np.zeros(n, np.uint8)) for i, n in enumerate(sizes)]
    files = safetensors_io.write(str(folder), iter(tensors),
                                 max_shard_size=100)
    assert len([f for f in files if f != safetensors_io.INDEX]) == shards


def test_one_shard_has_no_index_and_two_have_one(tmp_path):
  """One shard is `model.safetensors` alone; two or more get the index.
  No tensors at all still make one (empty) `model.safetensors`."""
  one, two, none = (tmp_path / d for d in ("one", "two", "none"))
  for d in (one, two, none):
    d.mkdir()
  tensors = [("a", np.zeros(8, np.uint8)), ("b", np.zeros(8, np.uint8))]
  assert safetensors_io.write(str(one), iter(tensors)) == [
      safetensors_io.SINGLE]
  assert safetensors_io.write(str(two), iter(tensors), max_shard_size=8) == [
      "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
      safetensors_io.INDEX]
  assert safetensors_io.write(str(none), iter([])) == [safetensors_io.SINGLE]
  assert safetensors_io.weight_map(str(none)) == {}
