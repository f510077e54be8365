"""The README's set-up commands are the ones CI runs, and the repository
ships everything its tests read."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts):
  with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
    return f.read()


def _readme_commands():
  """The one-line `sh` blocks of the README's set-up section."""
  readme = _read("README.md")
  setup = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
  return [b.strip() for b in re.findall(r"```sh\n(.*?)```", setup, re.S)]


def test_readme_has_exactly_two_setup_commands():
  commands = _readme_commands()
  assert len(commands) == 2, commands
  assert all("\n" not in c for c in commands), commands
  train, test = commands
  assert "python train.py --config=configs/ling3_tiny.py" in train
  assert "python -m pytest" in test


def test_ci_runs_the_readme_test_command_verbatim():
  ci_lines = [line.strip() for line in _read(".ci", "run").splitlines()]
  assert _readme_commands()[1] in ci_lines


def test_golden_fixture_ships_with_the_tests():
  path = os.path.join(ROOT, "tests", "testdata", "fla_kda_golden.npz")
  assert os.path.getsize(path) > 2_000_000
  assert "fla_kda_golden.npz" in _read("tests", "testdata", "README.md")
