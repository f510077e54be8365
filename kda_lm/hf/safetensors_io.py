"""Reading and writing safetensors checkpoints, one tensor at a time.

The format (https://huggingface.co/docs/safetensors): an 8-byte
little-endian header length N, N bytes of JSON (`{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}`, offsets relative to
the end of the header), then the raw little-endian data. A sharded
checkpoint adds `model.safetensors.index.json` (`{"metadata":
{"total_size"}, "weight_map": {name: shard file}}`).

A small reader of its own, not the `safetensors` package: that package's
numpy API has no bfloat16 (the published checkpoints' dtype), and reading
with `seek` + `numpy.fromfile` keeps one tensor in memory at a time.
"""

import json
import os
import re
from typing import Iterator, Optional, Union

import ml_dtypes
import numpy as np

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
           "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
           "F8_E4M3": ml_dtypes.float8_e4m3fn,
           "F8_E5M2": ml_dtypes.float8_e5m2}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def read_header(path: str) -> tuple[dict, int]:
  """(tensor entries by name, offset of the data) of one file."""
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise ValueError(f"{path} is not a safetensors file (too short).")
    n = int.from_bytes(raw, "little")
    try:
      header = json.loads(f.read(n))
    except ValueError as e:
      raise ValueError(f"{path} has a malformed safetensors header.") from e
  header.pop("__metadata__", None)
  return header, 8 + n


def weight_map(hf_dir: str) -> dict[str, str]:
  """Every tensor name -> the file (in `hf_dir`) that holds it.

  Raises:
    ValueError: neither `model.safetensors.index.json` nor
      `model.safetensors` is there, or the index names a missing file.
  """
  index = os.path.join(hf_dir, INDEX)
  if os.path.exists(index):
    with open(index) as f:
      wmap = json.load(f)["weight_map"]
    for shard in sorted(set(wmap.values())):
      if not os.path.exists(os.path.join(hf_dir, shard)):
        raise ValueError(f"{INDEX} names the shard {shard!r}, which is not "
                         f"in {hf_dir}.")
    return dict(wmap)
  single = os.path.join(hf_dir, SINGLE)
  if not os.path.exists(single):
    raise ValueError(f"{hf_dir} has neither {INDEX} nor {SINGLE}.")
  header, _ = read_header(single)
  return {name: SINGLE for name in header}


def iter_tensors(hf_dir: str, wmap: dict[str, str]
                 ) -> Iterator[tuple[str, np.ndarray]]:
  """(name, array) of every tensor, shard by shard, one read at a time."""
  by_file = {}
  for name, shard in wmap.items():
    by_file.setdefault(shard, []).append(name)
  for shard in sorted(by_file):
    path = os.path.join(hf_dir, shard)
    header, start = read_header(path)
    with open(path, "rb") as f:
      for name in by_file[shard]:
        if name not in header:
          raise ValueError(f"The index places tensor {name!r} in {shard}, "
                           f"which lacks it.")
        entry = header[name]
        dtype = np.dtype(_DTYPES[entry["dtype"]])
        begin, end = entry["data_offsets"]
        count = int(np.prod(entry["shape"], dtype=np.int64))
        if end - begin != count * dtype.itemsize:
          raise ValueError(f"Tensor {name!r} in {shard}: its data size "
                           f"does not match its shape and dtype.")
        f.seek(start + begin)
        array = np.fromfile(f, dtype=dtype.newbyteorder("<"), count=count)
        yield name, array.astype(dtype, copy=False).reshape(entry["shape"])


def parse_size(size: Union[int, str]) -> int:
  """Bytes of "5GB", "200KiB", "1000" or an int (HF's units: GB = 1e9)."""
  if isinstance(size, int):
    return size
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?I?B?)\s*",
                       str(size).upper())
  if not match:
    raise ValueError(f"max_shard_size must be bytes or like '5GB', got "
                     f"{size!r}.")
  return int(float(match.group(1)) * _UNITS[match.group(2)])


def _write_file(path: str, tensors: list[tuple[str, np.ndarray]]) -> None:
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, array in tensors:
    header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                    "data_offsets": [offset, offset + array.nbytes]}
    offset += array.nbytes
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)
  with open(path, "wb") as f:
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    for _, array in tensors:
      f.write(np.ascontiguousarray(array).astype(
          array.dtype.newbyteorder("<"), copy=False).tobytes())


def write(hf_dir: str, tensors: Iterator[tuple[str, np.ndarray]],
          max_shard_size: Union[int, str] = "5GB") -> list[str]:
  """Writes `tensors` as one file or as shards with an index.

  Shards fill up to `max_shard_size` bytes (a larger tensor gets a shard
  of its own) and are written as they fill, so at most one shard is held
  in memory; one shard is written as `model.safetensors` without index.

  Returns:
    The files written (names in `hf_dir`).
  """
  limit = parse_size(max_shard_size)
  written, current, size, total = [], [], 0, 0

  def flush():
    tmp = f".shard-{len(written):05d}.tmp"
    _write_file(os.path.join(hf_dir, tmp), current)
    written.append((tmp, [name for name, _ in current]))

  for name, array in tensors:
    if current and size + array.nbytes > limit:
      flush()
      current, size = [], 0
    current.append((name, array))
    size += array.nbytes
    total += array.nbytes
  if current or not written:
    flush()
  n, wmap, names = len(written), {}, []
  for k, (tmp, shard_names) in enumerate(written):
    fname = SINGLE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
    os.replace(os.path.join(hf_dir, tmp), os.path.join(hf_dir, fname))
    names.append(fname)
    wmap.update({name: fname for name in shard_names})
  if n > 1:
    with open(os.path.join(hf_dir, INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f,
                indent=2, sort_keys=True)
    names.append(INDEX)
  return names


def dtype_name(dtype: Optional[np.dtype]) -> str:
  """The safetensors name of a numpy dtype (e.g. "BF16")."""
  return _NAMES[np.dtype(dtype)]
