"""A real full disk: `train.py` stops with one error block and a
documented status, leaves no partial checkpoint, and resumes exactly.

The disk is a small tmpfs mounted for the test (CI runs as root); elsewhere
the test is skipped with the reason. A patched writer would not do: a full
disk fails Orbax's array writes in its background event loop and abandons
the others, which is where the hundreds of tracebacks came from.
"""

import glob
import os
import subprocess

import helpers
import process_support
import pytest

from kda_lm.checkpoint import manager as manager_lib

STEPS = ("--config.train.num_steps=20", "--config.checkpoint.every_steps=5",
         "--config.train.log_every=5", "--config.eval.every_steps=0")


def _size(path):
  return sum(os.path.getsize(os.path.join(root, name))
             for root, _, names in os.walk(path) for name in names)


@pytest.fixture
def small_disk(tmp_path):
  """mount(tmpfs) of a given size at tmp_path/disk, unmounted after."""
  mounted = []

  def mount(size):
    path = tmp_path / "disk"
    path.mkdir(exist_ok=True)
    opts = ("remount," if mounted else "") + f"size={size}"
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs",
                             str(path)], capture_output=True, text=True,
                            check=False)
    if result.returncode:
      pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    mounted.append(path)
    return str(path)

  if os.geteuid() != 0:
    pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
  yield mount
  if mounted:
    subprocess.run(["umount", str(mounted[0])], check=False)


def _train(config_file, workdir, cache_dir):
  return subprocess.run(
      helpers.train_command(config_file, workdir, *STEPS),
      cwd=process_support.REPO, env=process_support.subprocess_env(cache_dir),
      capture_output=True, text=True, timeout=300, check=False)


def test_full_disk_stops_in_one_block_and_resumes_exactly(
    tmp_path, data_dir, cache_dir, small_disk):  # noqa: F811
  config_file = helpers.write_config_file(tmp_path, data_dir)
  ref = str(tmp_path / "ref")
  assert _train(config_file, ref, cache_dir).returncode == 0
  ckpt = _size(os.path.join(ref, "checkpoints", "20"))
  rest = _size(ref) - _size(os.path.join(ref, "checkpoints"))
  # Room for the rest of the workdir and one checkpoint and a half: the
  # save of step 5 fits, the save of step 10 does not.
  disk = small_disk(rest + ckpt * 3 // 2 + (256 << 10))
  workdir = os.path.join(disk, "run")
  failed = _train(config_file, workdir, cache_dir)
  out = failed.stdout + failed.stderr
  assert failed.returncode == manager_lib.SAVE_FAILED_EXIT, out[-3000:]
  lines = out.splitlines()
  at = next(i for i, line in enumerate(lines)
            if "Saving the checkpoint" in line and "failed" in line)
  assert "No space left on device" in lines[at], lines[at]
  assert "resumes from step 5" in lines[at], lines[at]
  assert len(lines) - at <= 30, lines[at:]
  assert "Traceback" not in out, out[-3000:]
  checkpoints = os.path.join(workdir, "checkpoints")
  assert sorted(os.listdir(checkpoints)) == ["5"]
  assert not glob.glob(os.path.join(checkpoints, "*orbax-checkpoint-tmp*"))
  small_disk(8 * (rest + ckpt))                 # Space freed: resume.
  resumed = _train(config_file, workdir, cache_dir)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  want = {r["step"]: r["loss"] for r in helpers.train_rows(ref)}
  got = {r["step"]: r["loss"] for r in helpers.train_rows(workdir)}
  assert [s for s in got if s > 5] == [10, 15, 20]
  for step in (10, 15, 20):
    assert got[step] == want[step], step
