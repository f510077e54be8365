r"""Trains a kda-lm model: `python train.py --config=configs/ling3_tiny.py`.

Rerunning the same command resumes from the newest checkpoint in --workdir.
With `--config.mesh.distributed=True` every process runs this command with its
own `--config.mesh.process_id` (see `kda_lm/parallel/distributed.py`).

  python train.py --config=configs/ling3_tiny.py:kda_only \
      --config.train.num_steps=200 --workdir=/tmp/kda_only
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

import kda_lm  # noqa: F401  (first: sets XLA:CPU flags before JAX starts)
from kda_lm.parallel import distributed
from kda_lm.train import cli

try:  # The default config file takes its overrides here, not in app.run.
  _CONFIG = config_flags.DEFINE_config_file(
      "config",
      os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs",
                   "ling3_tiny.py"),
      "Training config file; `path.py:variant` selects a variant.",
      lock_config=True)
except cli.BAD_FLAG_ERRORS as error:
  cli.exit_on_bad_flag(error, sys.argv)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory (checkpoints, metrics); default "
    "runs/<config name>[_<variant>].")


def _default_workdir(config_arg: str) -> str:
  path, _, variant = config_arg.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  variant = variant.replace(",", "_")
  return os.path.join("runs", f"{name}_{variant}" if variant else name)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}.")
  # Before anything can touch a JAX backend (config checks included).
  distributed.initialize(_CONFIG.value.get("mesh"))
  # pylint: disable=g-import-not-at-top
  from kda_lm import logs
  from kda_lm.checkpoint import manager as manager_lib
  from kda_lm.train import loop as train_loop
  from kda_lm.train import metrics, preemption
  logs.quiet_library_logs()
  if logging.get_verbosity() <= logging.INFO:
    sys.stderr = noise = metrics.NoiseFilter(sys.stderr)
  else:
    noise = None
  workdir = _WORKDIR.value or _default_workdir(
      config_flags.get_config_filename(flags.FLAGS["config"]))
  logging.info("Config:\n%s", _CONFIG.value)
  try:
    train_loop.train_and_evaluate(_CONFIG.value, workdir)
  except preemption.Preempted as stopped:
    logging.warning("%s", stopped)
    distributed.shutdown()
    sys.exit(preemption.PREEMPTED_EXIT)
  except manager_lib.CheckpointSaveError as failed:
    # One block, then out at once: the interpreter's shutdown would print
    # the abandoned writes' unfinished coroutines.
    logging.error("%s", failed)
    if noise is not None and noise.dropped:
      logging.info("(%d tracebacks of the abandoned writes hidden; "
                   "--verbosity=1 shows them.)", noise.dropped)
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(manager_lib.SAVE_FAILED_EXIT)  # pylint: disable=protected-access
  # After a successful run only: after a failure the other processes may
  # never reach the barrier, and JAX's own exit handler disconnects.
  distributed.shutdown()


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
