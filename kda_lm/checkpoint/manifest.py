"""A checkpoint step's manifest: the size and SHA-256 of every file.

Written once a step is complete (`CheckpointManager` does it for the
newest save) and verified before a restore, so that bytes changed, a file
lost or a file added after the save are named instead of read.

Files are reached through `etils.epath`: a step may be a local directory or
under a `gs://` URL. With several processes each hashes a share of the
files (`verify_manifest(step_dir, share=(index, count))`), so that every
file is read once in all; the manager combines their verdicts.
"""

import hashlib
import json

from etils import epath

from kda_lm.checkpoint import paths

MANIFEST_FILE = "manifest.json"
# Bytes read at a time while hashing (large reads suit object stores).
_CHUNK_BYTES = 8 << 20


class CorruptCheckpointError(ValueError):
  """A checkpoint's files do not match the manifest written with it."""


def _sha256(path: epath.Path) -> str:
  digest = hashlib.sha256()
  with path.open("rb") as f:
    while chunk := f.read(_CHUNK_BYTES):
      digest.update(chunk)
  return digest.hexdigest()


def _step_files(step_dir: epath.Path) -> dict[str, epath.Path]:
  """Maps relative paths to the paths of a step's files (no manifest)."""
  return {rel: path for rel, path in paths.files(step_dir)
          if rel != MANIFEST_FILE}


def write_manifest(step_dir: epath.PathLike) -> None:
  """Writes `manifest.json`: size and SHA-256 of every file of a step.

  On a local disk it is written beside and renamed (atomic); on an object
  store a single write is atomic already, and a rename is a copy.
  """
  step_dir = epath.Path(step_dir)
  entries = {rel: {"bytes": paths.size(path), "sha256": _sha256(path)}
             for rel, path in sorted(_step_files(step_dir).items())}
  text = json.dumps({"files": entries}, indent=1, sort_keys=True)
  target = step_dir / MANIFEST_FILE
  if paths.is_remote(step_dir):
    target.write_text(text)
    return
  tmp = step_dir / (MANIFEST_FILE + ".tmp")
  tmp.write_text(text)
  tmp.replace(target)


def _check_listing(expected: dict[str, dict], found: dict[str, epath.Path]
                   ) -> None:
  """Raises for the first file missing, extra or of another size."""
  for rel in sorted(set(expected) | set(found)):
    if rel not in found:
      raise CorruptCheckpointError(f"{rel} is missing")
    if rel not in expected:
      raise CorruptCheckpointError(f"{rel} is not in the manifest")
    size = paths.size(found[rel])
    if size != expected[rel]["bytes"]:
      raise CorruptCheckpointError(
          f"{rel} has {size} bytes, the manifest says "
          f"{expected[rel]['bytes']}")


def verify_manifest(step_dir: epath.PathLike,
                    share: tuple[int, int] = (0, 1)) -> bool:
  """Checks a step's files against its manifest.

  The file list and every size are checked whatever the share (cheap); the
  checksums only of the files `sorted(files)[index::count]`.

  Args:
    step_dir: the step's directory (local, or a URL such as `gs://...`).
    share: `(index, count)`: hash this share of the files; `(0, 1)`, the
      default, hashes them all. Process `i` of `n` passes `(i, n)`.

  Returns:
    True if verified; False if the step has no manifest (a process stopped
    between the end of the save and the manifest).

  Raises:
    CorruptCheckpointError: a file is missing, extra, or differs in size or
      (in this share) checksum; the message names the first such file.
    ValueError: `share` is not `(index, count)` with `0 <= index < count`.
  """
  index, count = share
  if not 0 <= index < count:
    raise ValueError(f"share must be (index, count) with 0 <= index < "
                     f"count, got {share}")
  step_dir = epath.Path(step_dir)
  path = step_dir / MANIFEST_FILE
  if not path.exists():
    return False
  expected = json.loads(path.read_text())["files"]
  found = _step_files(step_dir)
  _check_listing(expected, found)
  for rel in sorted(expected)[index::count]:
    if _sha256(found[rel]) != expected[rel]["sha256"]:
      raise CorruptCheckpointError(
          f"{rel} does not match its SHA-256 in the manifest (its bytes "
          "changed after the save)")
  return True
