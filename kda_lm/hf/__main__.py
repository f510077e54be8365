r"""`python -m kda_lm.hf import|export`: checkpoints <-> run directories.

  python -m kda_lm.hf import --hf_dir=DIR --workdir=W \
      [--config=configs/ling3_tiny.py] [--dtype=bfloat16]
  python -m kda_lm.hf export --workdir=W --hf_dir=DIR [--max_shard_size=5GB]

`import` writes a run directory at step 0 (`kda_lm/hf/workdir.py`) whose
sections besides `model` come from `--config`; fine-tune it with
`python train.py --config=configs/ling3.py:imported=W --workdir=W`.
`export` writes the run's newest parameters in the format of its KDA gate
(`bailing_hybrid` for `ling`, `kimi_linear` for `kimi`, or `--model_type`).
"""

import os

from absl import app, flags
from ml_collections import config_flags

import kda_lm  # noqa: F401  # isort: skip  (first: XLA:CPU flags)
from kda_lm import logs
from kda_lm.hf import workdir as hf_workdir

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "configs", "ling3_tiny.py"),
    "import: the training config whose sections besides `model` the run "
    "takes.", lock_config=False)
_HF_DIR = flags.DEFINE_string("hf_dir", None, "The checkpoint directory.")
_WORKDIR = flags.DEFINE_string("workdir", None, "The run directory.")
_DTYPE = flags.DEFINE_enum("dtype", None,
                           ["float32", "bfloat16", "float16"],
                           "import: parameter dtype (default the "
                           "checkpoint's).")
_SCAN = flags.DEFINE_bool("scan_layers", False,
                          "import: scan the repeated layer group "
                          "(config.model.scan_layers; real sizes).")
_MAX_SHARD = flags.DEFINE_string("max_shard_size", "5GB",
                                 "export: bytes per safetensors shard.")
_MODEL_TYPE = flags.DEFINE_enum(
    "model_type", None, ["bailing_hybrid", "kimi_linear"],
    "export: the format (default: by the model's KDA gate form).")


def main(argv):
  if len(argv) != 2 or argv[1] not in ("import", "export"):
    raise app.UsageError("Usage: python -m kda_lm.hf import|export "
                         "--hf_dir=DIR --workdir=W")
  logs.quiet_library_logs()
  if not _HF_DIR.value or not _WORKDIR.value:
    raise app.UsageError("--hf_dir and --workdir are required.")
  if argv[1] == "import":
    hf_workdir.import_checkpoint(_HF_DIR.value, _WORKDIR.value,
                                 _CONFIG.value, dtype=_DTYPE.value,
                                 scan_layers=_SCAN.value)
    print(f"Imported {_HF_DIR.value} into {_WORKDIR.value} (step 0).")
  else:
    run = hf_workdir.export_checkpoint(
        _WORKDIR.value, _HF_DIR.value, max_shard_size=_MAX_SHARD.value,
        model_type=_MODEL_TYPE.value)
    print(f"Exported {run.workdir} (step {run.step}) to {_HF_DIR.value}.")


if __name__ == "__main__":
  app.run(main)
