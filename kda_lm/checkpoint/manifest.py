"""A checkpoint step's manifest: the size and SHA-256 of every file.

Written once a step is complete (`CheckpointManager` does it for the
newest save) and verified before a restore, so that bytes changed, a file
lost or a file added after the save are named instead of read.
"""

import hashlib
import json
import os

MANIFEST_FILE = "manifest.json"


class CorruptCheckpointError(ValueError):
  """A checkpoint's files do not match the manifest written with it."""


def _sha256(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def _step_files(step_dir: str) -> dict[str, str]:
  """Maps relative paths to absolute paths of a step's files (no manifest)."""
  files = {}
  for root, _, names in os.walk(step_dir):
    for name in names:
      path = os.path.join(root, name)
      rel = os.path.relpath(path, step_dir)
      if rel != MANIFEST_FILE:
        files[rel] = path
  return files


def write_manifest(step_dir: str) -> None:
  """Writes `manifest.json`: size and SHA-256 of every file of a step."""
  entries = {rel: {"bytes": os.path.getsize(path),
                    "sha256": _sha256(path)}
             for rel, path in sorted(_step_files(step_dir).items())}
  path = os.path.join(step_dir, MANIFEST_FILE)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump({"files": entries}, f, indent=1, sort_keys=True)
  os.replace(path + ".tmp", path)


def verify_manifest(step_dir: str) -> bool:
  """Checks a step's files against its manifest.

  Args:
    step_dir: the step's directory.

  Returns:
    True if verified; False if the step has no manifest (a process stopped
    between the end of the save and the manifest).

  Raises:
    CorruptCheckpointError: a file is missing, extra, or differs in size or
      checksum; the message names the first such file.
  """
  path = os.path.join(step_dir, MANIFEST_FILE)
  if not os.path.exists(path):
    return False
  with open(path, encoding="utf-8") as f:
    expected = json.load(f)["files"]
  found = _step_files(step_dir)
  for rel in sorted(set(expected) | set(found)):
    if rel not in found:
      raise CorruptCheckpointError(f"{rel} is missing")
    if rel not in expected:
      raise CorruptCheckpointError(f"{rel} is not in the manifest")
    size = os.path.getsize(found[rel])
    if size != expected[rel]["bytes"]:
      raise CorruptCheckpointError(
          f"{rel} has {size} bytes, the manifest says "
          f"{expected[rel]['bytes']}")
    if _sha256(found[rel]) != expected[rel]["sha256"]:
      raise CorruptCheckpointError(
          f"{rel} does not match its SHA-256 in the manifest (its bytes "
          "changed after the save)")
  return True
