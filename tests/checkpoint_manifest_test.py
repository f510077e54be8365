"""Tests of kda_lm.checkpoint.paths and manifest: local and remote paths
through `etils.epath`, a manifest on a fake `gs://` store, the checkpoint
modules' file access, and the manifest on plain directories (what it
lists, each way a file can differ from it, the message naming the
first)."""

import hashlib
import inspect
import json
import os
import pwd
import re

from etils import epath
from etils.epath import gpath
from etils.epath import testing as epath_testing
import pytest

from kda_lm.checkpoint import manager as manager_lib
from kda_lm.checkpoint import manifest, paths

_FILES = {"a.bin": b"abc", "state/d/x.bin": bytes(range(256)) * 2,
          "state/m.json": b"{}", "z.txt": b""}


def _make_step_dir(root: epath.PathLike) -> epath.Path:
  """A step-like directory of `_FILES` under `root` (local or fake gs)."""
  step_dir = epath.Path(root) / "7"
  for rel, data in _FILES.items():
    (step_dir / rel).parent.mkdir(parents=True, exist_ok=True)
    (step_dir / rel).write_bytes(data)
  return step_dir


@pytest.mark.parametrize("path,remote", [
    ("gs://x/y", True), ("s3://bucket/run", True),
    (epath.Path("gs://x/y"), True), ("/tmp/x", False), ("~/x", False),
    ("rel/ckpt", False), (epath.Path("/tmp/x"), False),
])
def test_remote_or_local(path, remote):
  assert paths.is_remote(path) is remote


def test_only_a_local_path_is_made_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert paths.absolute("rel/ckpt") == str(tmp_path / "rel" / "ckpt")
  assert paths.absolute("~/x") == str(tmp_path / "home" / "x")
  assert paths.absolute(epath.Path("gs://b/run/checkpoints")) == (
      "gs://b/run/checkpoints")
  assert paths.absolute("gs://b/~/x") == "gs://b/~/x"


def test_the_free_space_check_is_skipped_on_an_object_store(
    tmp_path, monkeypatch):
  usage = manager_lib.shutil.disk_usage(tmp_path)
  monkeypatch.setattr(manager_lib.shutil, "disk_usage", lambda _: usage)
  manager = object.__new__(manager_lib.CheckpointManager)
  # pylint: disable=protected-access
  manager.directory = str(tmp_path)
  assert manager._free_bytes() == usage.free
  manager.directory = "gs://bucket/run/checkpoints"
  assert manager._free_bytes() is None


@pytest.mark.parametrize("as_path", [str, epath.Path], ids=["str", "epath"])
def test_manifest_round_trip_on_a_local_directory(tmp_path, as_path):
  step_dir = as_path(os.fspath(_make_step_dir(tmp_path)))
  manifest.write_manifest(step_dir)
  assert manifest.verify_manifest(step_dir) is True
  assert sorted(os.listdir(step_dir)) == [
      "a.bin", manifest.MANIFEST_FILE, "state", "z.txt"]   # No temporary.
  (epath.Path(step_dir) / "state" / "m.json").write_bytes(b"[]")
  with pytest.raises(manifest.CorruptCheckpointError,
                     match="^state/m.json does not match its SHA-256"):
    manifest.verify_manifest(step_dir)


def test_a_user_id_without_a_name_is_no_obstacle(tmp_path, monkeypatch):
  """epath's `stat` looks up the owner's name; some containers run under a
  user id that has none."""
  def no_name(uid):
    raise KeyError(f"getpwuid(): uid not found: {uid}")

  monkeypatch.setattr(pwd, "getpwuid", no_name)
  step_dir = _make_step_dir(tmp_path)
  manifest.write_manifest(step_dir)
  assert manifest.verify_manifest(step_dir)
  # pylint: disable-next=protected-access
  assert manager_lib._tree_bytes(step_dir) > sum(map(len, _FILES.values()))


@pytest.fixture(name="fake_gcs")
def _fake_gcs(tmp_path, monkeypatch):
  """`gs://` served by epath's mock backend from `tmp_path/gcs`; yields the
  list of `(operation, path)` it was asked for."""
  root, calls = tmp_path / "gcs", []
  root.mkdir()

  def local(path):
    path = os.fspath(path)
    assert path.startswith("gs://"), path
    return str(root / path[len("gs://"):])

  def one_path(name):
    def fn(original, path, *args, **kwargs):
      calls.append((name, os.fspath(path)))
      return original(local(path), *args, **kwargs)
    return fn

  def two_paths(name):
    def fn(original, path, dst):
      calls.append((name, os.fspath(path)))
      return original(local(path), local(dst))
    return fn

  names = ("exists", "isdir", "listdir", "makedirs", "mkdir", "open",
           "remove", "rmtree", "stat")
  mocks = {name: one_path(name) for name in names}
  mocks.update(rename=two_paths("rename"), replace=two_paths("replace"))
  # With TensorFlow installed epath serves gs:// with it, whatever the mock.
  monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)
  with epath_testing.mock_epath(**mocks):
    yield calls


def test_manifest_round_trip_on_a_fake_gcs_bucket(fake_gcs, tmp_path):
  step_dir = _make_step_dir("gs://bucket/run/checkpoints")
  fake_gcs.clear()
  manifest.write_manifest("gs://bucket/run/checkpoints/7")
  # One write of the final name: no temporary file renamed.
  assert not [c for c in fake_gcs if c[0] in ("rename", "replace")]
  assert ("open", f"{step_dir}/{manifest.MANIFEST_FILE}") in fake_gcs
  local = tmp_path / "gcs" / "bucket" / "run" / "checkpoints" / "7"
  assert sorted(os.listdir(local)) == [
      "a.bin", manifest.MANIFEST_FILE, "state", "z.txt"]
  assert manifest.verify_manifest(step_dir) is True
  assert all(path.startswith("gs://") for _, path in fake_gcs)
  (local / "state" / "d" / "x.bin").write_bytes(b"\0" * 512)
  with pytest.raises(manifest.CorruptCheckpointError,
                     match="^state/d/x.bin does not match its SHA-256"):
    manifest.verify_manifest(step_dir)
  (local / "a.bin").unlink()
  with pytest.raises(manifest.CorruptCheckpointError,
                     match="^a.bin is missing$"):
    manifest.verify_manifest(step_dir)


# Calls that reach only the local disk, whatever the path: a `gs://`
# checkpoint directory would fail or be read as a relative local path.
# The checkpoint modules go through `etils.epath` (and `paths`) instead.
_LOCAL_ONLY = re.compile(
    r"\bos\.(path|walk|listdir|scandir|rename|replace|remove|makedirs|stat)"
    r"\b|(?<![\w.])open\(|\bshutil\.(rmtree|copy|move)")


@pytest.mark.parametrize("module", [manager_lib, manifest],
                         ids=["manager", "manifest"])
def test_checkpoint_files_are_reached_through_epath(module):
  found = _LOCAL_ONLY.findall(inspect.getsource(module))
  assert not found, found


def test_the_structural_check_sees_local_only_calls():
  assert _LOCAL_ONLY.search("x = os.path.join(a, b)")
  assert _LOCAL_ONLY.search("with open(path) as f:")
  assert _LOCAL_ONLY.search("for r, _, n in os.walk(d):")
  assert not _LOCAL_ONLY.search("with path.open('rb') as f:")


# Verification shared between processes: each hashes its share.


@pytest.fixture(name="hashed")
def _hashed(monkeypatch):
  """The files `manifest` hashes, in order (relative to their step)."""
  seen, sha256 = [], manifest._sha256  # pylint: disable=protected-access

  def counted(path):
    seen.append(path)
    return sha256(path)

  monkeypatch.setattr(manifest, "_sha256", counted)
  return seen


def _rel(step_dir, hashed):
  return [os.path.relpath(os.fspath(p), os.fspath(step_dir)) for p in hashed]


def test_two_shares_hash_every_file_once(tmp_path, hashed):
  step_dir = _make_step_dir(tmp_path)
  manifest.write_manifest(step_dir)
  hashed.clear()
  assert manifest.verify_manifest(step_dir, share=(0, 2))
  first = _rel(step_dir, hashed)
  hashed.clear()
  assert manifest.verify_manifest(step_dir, share=(1, 2))
  second = _rel(step_dir, hashed)
  assert first == ["a.bin", "state/m.json"]
  assert second == ["state/d/x.bin", "z.txt"]
  hashed.clear()
  assert manifest.verify_manifest(step_dir)    # Alone: every file.
  assert _rel(step_dir, hashed) == sorted(_FILES)


# Every file that has other bytes of its size (not the empty z.txt).
@pytest.mark.parametrize("index", range(len(_FILES) - 1))
def test_a_changed_file_is_found_by_the_share_that_owns_it(tmp_path, index):
  step_dir = _make_step_dir(tmp_path)
  manifest.write_manifest(step_dir)
  rel = sorted(_FILES)[index]
  data = _FILES[rel]
  (step_dir / rel).write_bytes(bytes([data[0] ^ 1]) + data[1:])
  for share in range(2):
    if share == index % 2:
      with pytest.raises(manifest.CorruptCheckpointError,
                         match=f"^{re.escape(rel)} does not match"):
        manifest.verify_manifest(step_dir, share=(share, 2))
    else:
      assert manifest.verify_manifest(step_dir, share=(share, 2))


@pytest.mark.parametrize("change,message", [
    ("resize", "state/d/x.bin has 3 bytes, the manifest says 512"),
    ("delete", "z.txt is missing"),
    ("add", "state/new.bin is not in the manifest"),
])
def test_the_listing_and_sizes_are_checked_by_every_share(
    tmp_path, hashed, change, message):
  step_dir = _make_step_dir(tmp_path)
  manifest.write_manifest(step_dir)
  if change == "resize":
    (step_dir / "state" / "d" / "x.bin").write_bytes(b"abc")
  elif change == "delete":
    (step_dir / "z.txt").unlink()
  else:
    (step_dir / "state" / "new.bin").write_bytes(b"new")
  hashed.clear()
  for share in range(3):
    with pytest.raises(manifest.CorruptCheckpointError) as info:
      manifest.verify_manifest(step_dir, share=(share, 3))
    assert str(info.value) == message
  assert not hashed                   # Found before any file is hashed.


@pytest.mark.parametrize("share", [(2, 2), (-1, 2), (0, 0)])
def test_a_share_out_of_range_is_refused(tmp_path, share):
  with pytest.raises(ValueError, match="0 <= index < count"):
    manifest.verify_manifest(_make_step_dir(tmp_path), share=share)


def test_a_files_sha256_is_its_contents(tmp_path):
  """Read in chunks: one over a chunk's bytes."""
  path = epath.Path(tmp_path) / "big.bin"
  # pylint: disable-next=protected-access
  data = os.urandom(manifest._CHUNK_BYTES + 5)
  path.write_bytes(data)
  # pylint: disable-next=protected-access
  assert manifest._sha256(path) == hashlib.sha256(data).hexdigest()


def test_has_entries_of_a_directory(tmp_path):
  """A missing or empty directory holds no checkpoint; one with a file
  does."""
  assert not paths.has_entries(tmp_path / "missing")
  assert not paths.has_entries(tmp_path)
  (tmp_path / "1").mkdir()
  assert paths.has_entries(tmp_path)


# The manifest on plain directories (no Orbax): what it lists, each way a
# file can differ from it, and the message naming the first such file.


def _make_plain_step_dir(root) -> str:
  """A step-like directory with files sorting before and after
  `manifest.json`, one nested, one over 256 bytes."""
  step_dir = os.path.join(str(root), "7")
  os.makedirs(os.path.join(step_dir, "state", "d"))
  for rel, data in (("a.bin", b"abc"), ("state/d/x.bin", bytes(range(256)) * 2),
                    ("z.txt", b"")):
    with open(os.path.join(step_dir, rel), "wb") as f:
      f.write(data)
  return step_dir


def test_manifest_lists_every_file_with_its_size_and_sha256(tmp_path):
  step_dir = _make_plain_step_dir(tmp_path)
  manifest.write_manifest(step_dir)
  manifest.write_manifest(step_dir)     # Not listing itself.
  want = {"files": {
      rel: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
      for rel, data in (("a.bin", b"abc"),
                        ("state/d/x.bin", bytes(range(256)) * 2),
                        ("z.txt", b""))}}
  with open(os.path.join(step_dir, manifest.MANIFEST_FILE)) as f:
    assert f.read() == json.dumps(want, indent=1, sort_keys=True)
  assert sorted(os.listdir(step_dir)) == [
      "a.bin", manifest.MANIFEST_FILE, "state", "z.txt"]
  assert manifest.verify_manifest(step_dir) is True


def test_step_without_manifest_is_not_verified(tmp_path):
  assert manifest.verify_manifest(_make_plain_step_dir(tmp_path)) is False


def _rewrite(path: str, data: bytes) -> None:
  with open(path, "wb") as f:
    f.write(data)


@pytest.mark.parametrize("rel,data,message", [
    ("a.bin", b"abcd", "a.bin has 4 bytes, the manifest says 3"),
    ("a.bin", b"ab", "a.bin has 2 bytes, the manifest says 3"),
    ("state/d/x.bin", bytes(range(256)) * 2 + b"\0",
     "state/d/x.bin has 513 bytes, the manifest says 512"),
    ("z.txt", b"\0", "z.txt has 1 bytes, the manifest says 0"),
])
def test_a_file_of_another_size_is_named(tmp_path, rel, data, message):
  step_dir = _make_plain_step_dir(tmp_path)
  manifest.write_manifest(step_dir)
  _rewrite(os.path.join(step_dir, rel), data)
  with pytest.raises(manifest.CorruptCheckpointError) as info:
    manifest.verify_manifest(step_dir)
  assert str(info.value) == message


@pytest.mark.parametrize("higher", [True, False])
def test_a_file_with_other_bytes_of_the_same_size_is_named(tmp_path, higher):
  """Changed bytes whose SHA-256 sorts after, or before, the saved one."""
  step_dir = _make_plain_step_dir(tmp_path)
  manifest.write_manifest(step_dir)
  saved = hashlib.sha256(b"abc").hexdigest()
  data = next(d for d in (bytes([i, 98, 99]) for i in range(256))
              if (hashlib.sha256(d).hexdigest() > saved) == higher
              and d != b"abc")
  _rewrite(os.path.join(step_dir, "a.bin"), data)
  with pytest.raises(manifest.CorruptCheckpointError) as info:
    manifest.verify_manifest(step_dir)
  assert str(info.value) == (
      "a.bin does not match its SHA-256 in the manifest (its bytes changed "
      "after the save)")


def test_the_first_of_several_differences_is_named(tmp_path):
  step_dir = _make_plain_step_dir(tmp_path)
  manifest.write_manifest(step_dir)
  os.remove(os.path.join(step_dir, "z.txt"))
  _rewrite(os.path.join(step_dir, "state", "b.bin"), b"new")
  with pytest.raises(manifest.CorruptCheckpointError,
                     match="^state/b.bin is not in the manifest$"):
    manifest.verify_manifest(step_dir)
  os.remove(os.path.join(step_dir, "state", "b.bin"))
  with pytest.raises(manifest.CorruptCheckpointError,
                     match="^z.txt is missing$"):
    manifest.verify_manifest(step_dir)
