"""Tests of kda_lm/train/cli.py: a bad `--config.` flag in one line."""

import os
import subprocess
import sys

from absl import flags
import process_support
import pytest

from kda_lm.train import cli


@pytest.mark.parametrize("arg,error,want", [
    ("--config.train.num_step=5",
     AttributeError('\\\'num_step\\\'\\nDid you mean "num_steps" instead '
                    'of "num_step"?'),
     "unknown config key config.train.num_step; did you mean "
     "config.train.num_steps?"),
    ("--config.trian.num_steps=5",
     KeyError('\\\'trian\\\'\\nDid you mean "train" instead of "trian"?'),
     "unknown config key config.trian.num_steps; did you mean "
     "config.train.num_steps?"),
    ("--config.train.zzz=5", KeyError("'zzz'"),
     "unknown config key config.train.zzz"),
    ("--config.train.num_steps=abc",
     flags.IllegalFlagValueError("flag --config.train.num_steps=abc: "
                                 "invalid literal for int()"),
     "bad command-line flag: flag --config.train.num_steps=abc: invalid "
     "literal for int()"),
])
def test_config_flag_message_names_the_key_and_the_fix(arg, error, want):
  assert cli.config_flag_message(error, ["train.py", arg]) == want


@pytest.mark.parametrize("config", [["--config=configs/ling3_tiny.py"], []],
                         ids=["named_config", "default_config"])
def test_a_typo_exits_2_with_one_line_and_no_workdir(tmp_path, config):
  """With the default config file too (its overrides are applied while
  train.py defines the flag, before absl's parsing)."""
  workdir = tmp_path / "run"
  result = subprocess.run(
      [sys.executable, os.path.join(process_support.REPO, "train.py")]
      + config + ["--config.train.num_step=5", f"--workdir={workdir}"],
      cwd=process_support.REPO,
      env=process_support.subprocess_env(), capture_output=True, text=True,
      timeout=120, check=False)
  assert result.returncode == cli.USAGE_EXIT, result.stderr[-2000:]
  lines = [line for line in result.stderr.splitlines()
           if line.startswith("train.py:")]
  assert lines == ["train.py: unknown config key config.train.num_step; "
                   "did you mean config.train.num_steps?"], result.stderr
  assert "Traceback" not in result.stderr
  assert not workdir.exists()
