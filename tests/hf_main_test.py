"""Tests of kda_lm/hf/__main__.py: `python -m kda_lm.hf import|export`.

Each flag must reach kda_lm/hf/workdir.py's `import_checkpoint` or
`export_checkpoint` (stand-ins here, recording their arguments: no
checkpoint is read or written), and a bad command line must be refused
before either runs. One subprocess checks the module's `app.run` wiring.
"""

import os
import subprocess
import sys
import types
from unittest import mock

from absl import app, flags
from absl import logging as absl_logging
import process_support
import pytest

from configs import ling3_tiny
from kda_lm.hf import __main__ as hf_main
from kda_lm.hf import workdir as hf_workdir

FLAGS = flags.FLAGS


@pytest.fixture
def calls(monkeypatch):
  """The stand-ins' calls, as (name, args, kwargs). After the test the flags
  are unparsed and absl's logger is as it was (parsing sets its level from
  `--verbosity`; `main` adds a filter), so later tests' logs still show."""
  got = []
  logger = absl_logging.get_absl_logger()
  level, filters = logger.level, list(logger.filters)

  def import_checkpoint(*args, **kwargs):
    got.append(("import", args, kwargs))

  def export_checkpoint(*args, **kwargs):
    got.append(("export", args, kwargs))
    return types.SimpleNamespace(workdir=args[0], step=7)

  monkeypatch.setattr(hf_workdir, "import_checkpoint", import_checkpoint)
  monkeypatch.setattr(hf_workdir, "export_checkpoint", export_checkpoint)
  try:
    yield got
  finally:
    FLAGS.unparse_flags()
    logger.setLevel(level)
    logger.filters[:] = filters


def run_main(*argv):
  """Parses `argv` as the command line's flags, then runs `main`.

  `sys.argv` too: the config flag reads its `--config.a.b=` overrides there.
  Each argument is a new string, as a real command line's are (a literal
  here would be the same object as the module's, hiding an `is`).
  """
  argv = ["kda_lm.hf", *("".join(list(arg)) for arg in argv)]
  FLAGS.unparse_flags()
  with mock.patch.object(sys, "argv", argv):
    hf_main.main(FLAGS(argv))


def test_import_passes_each_flag(calls, capsys):
  run_main("import", "--hf_dir=ckpt", "--workdir=run", "--dtype=bfloat16",
           "--scan_layers")
  (name, args, kwargs), = calls
  assert name == "import" and args[:2] == ("ckpt", "run")
  assert kwargs == {"dtype": "bfloat16", "scan_layers": True}
  # The default config is the repository's configs/ling3_tiny.py, and the
  # import may add to it (not locked).
  assert args[2].to_dict() == ling3_tiny.get_config().to_dict()
  assert not args[2].is_locked
  assert capsys.readouterr().out == "Imported ckpt into run (step 0).\n"


def test_import_defaults_and_a_config_variant(calls):
  config = os.path.join(process_support.REPO, "configs", "ling3_tiny.py")
  run_main("import", "--hf_dir=h", "--workdir=w",
           f"--config={config}:kda_only", "--config.train.num_steps=3")
  (_, args, kwargs), = calls
  assert kwargs == {"dtype": None, "scan_layers": False}
  want = ling3_tiny.get_config("kda_only")
  want.train.num_steps = 3
  assert args[2].to_dict() == want.to_dict()


@pytest.mark.parametrize("argv, want", [
    (("--workdir=run", "--hf_dir=out"),
     {"max_shard_size": "5GB", "model_type": None}),
    (("--workdir=run", "--hf_dir=out", "--max_shard_size=10MB",
      "--model_type=kimi_linear"),
     {"max_shard_size": "10MB", "model_type": "kimi_linear"}),
])
def test_export_passes_each_flag(calls, capsys, argv, want):
  run_main("export", *argv)
  assert calls == [("export", ("run", "out"), want)]
  assert capsys.readouterr().out == "Exported run (step 7) to out.\n"


@pytest.mark.parametrize("argv, match", [
    ((), "Usage"),
    (("convert", "--hf_dir=h", "--workdir=w"), "Usage"),
    (("import", "export", "--hf_dir=h", "--workdir=w"), "Usage"),
    (("import", "--workdir=w"), "--hf_dir and --workdir are required"),
    (("export", "--hf_dir=h"), "--hf_dir and --workdir are required"),
    (("import",), "--hf_dir and --workdir are required"),
])
def test_bad_command_lines_are_refused_before_any_work(calls, argv, match):
  with pytest.raises(app.UsageError, match=match):
    run_main(*argv)
  assert not calls


@pytest.mark.parametrize("flag", ["--dtype=int8", "--model_type=llama"])
def test_unknown_choices_are_refused(calls, flag):
  with pytest.raises(flags.IllegalFlagValueError):
    run_main("import", "--hf_dir=h", "--workdir=w", flag)


def test_the_module_runs_as_a_command():
  done = subprocess.run(
      [sys.executable, "-m", "kda_lm.hf", "convert"], capture_output=True,
      text=True, env=process_support.subprocess_env(), timeout=300,
      check=False)
  assert done.returncode == 1, done.stderr
  assert "Usage: python -m kda_lm.hf import|export" in (
      done.stdout + done.stderr)
