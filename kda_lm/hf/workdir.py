"""A Hugging Face checkpoint directory <-> a kda-lm run directory.

`import_checkpoint` writes a workdir that `train.py`, `kda_lm.infer.
evaluate` and `kda_lm.infer.generate` accept: the training config (its
`model` section the imported one, the other sections from a training
config), a step-0 checkpoint holding the imported parameters, a fresh
optimizer state and the data stream at its start, written through
`kda_lm.checkpoint` like a training run's; and the checkpoint's
`tokenizer.json`, if it has one, as `<workdir>/tokenizer.json`
(`generate --prompt` encodes text with it). Fine-tuning is then
`python train.py --config=configs/ling3.py:imported=W --workdir=W`.

`export_checkpoint` writes a workdir's newest parameters as a checkpoint
directory (`save_pretrained`), with its tokenizer and, for an imported run,
the source `config.json`'s token ids and other fields kda-lm does not model
(kept at import as `<workdir>/hf_source_config.json`); a run trained here
exports null token ids.
"""

import json
import os
import shutil
from typing import Any, Optional, Union

from absl import logging
import jax
import ml_collections

from data import pipeline
from data import tokenizer as tokenizer_lib
from kda_lm import config as config_lib
from kda_lm.checkpoint import manager as manager_lib
from kda_lm.checkpoint import workdir as workdir_lib
from kda_lm.hf import convert, formats
from kda_lm.parallel import sharding
from kda_lm.train import state as state_lib

# The imported checkpoint's config.json, kept so that an export carries
# its token ids and the other fields kda-lm does not model.
SOURCE_CONFIG = "hf_source_config.json"


def _initial_state(run, params, mesh) -> state_lib.TrainState:
  """Step 0 as a fresh run starts it (`state.run_state_layout`), with the
  imported parameters."""
  layout = state_lib.run_state_layout(run, mesh)
  return jax.jit(layout.init, out_shardings=layout.shardings)(
      state_lib.init_key(run), params)


def import_checkpoint(hf_dir: str, workdir: str,
                      config: ml_collections.ConfigDict, *,
                      dtype: Optional[str] = None,
                      scan_layers: bool = False) -> ml_collections.ConfigDict:
  """Imports `hf_dir` into a new run directory.

  Args:
    hf_dir: the checkpoint directory (`load_pretrained`).
    workdir: the run directory to create; must hold no run yet.
    config: a training config whose sections besides `model` the run
      takes (its `model` section is replaced by the imported one).
    dtype: the parameters' dtype; None = the checkpoint's.
    scan_layers: the run scans its layer group (`config.model.scan_layers`,
      the parameters in the scanned layout).

  Returns:
    The run's config, as recorded in `<workdir>/config.json`.

  Raises:
    ValueError: `workdir` already holds a run, or the checkpoint or config
      is refused (see `load_pretrained`, `state.check_config`).
  """
  workdir = os.path.abspath(os.path.expanduser(workdir))
  if workdir_lib.read_config(workdir) is not None:
    raise ValueError(f"{workdir} already holds a run; import into a new "
                     f"--workdir.")
  config = ml_collections.ConfigDict(config.to_dict())
  hf_config = convert.read_config(hf_dir)
  config.model = ml_collections.ConfigDict(
      formats.from_hf(hf_config, dtype=dtype).to_dict())
  config.model.scan_layers = scan_layers
  os.makedirs(workdir, exist_ok=True)
  with workdir_lib.WorkdirLock(workdir):
    config = pipeline.resolve_config(config, workdir, None)
    run = config_lib.check_config(config)
    mesh = sharding.make_mesh(run.mesh)
    _, params = convert.load_pretrained(hf_dir, dtype=dtype, mesh=mesh,
                                        scan_layers=scan_layers)
    state = _initial_state(run, params, mesh)
    config_json = json.loads(config.to_json_best_effort())
    train_it = pipeline.make_train_iterator(run.data, workdir=workdir)
    manager = manager_lib.CheckpointManager(
        workdir_lib.checkpoint_dir(workdir), max_to_keep=None,
        async_save=False)
    try:
      manager.save(0, state, train_it, config=config_json)
      manager.wait_until_finished()
    finally:
      manager.close()
    workdir_lib.write_config(workdir, config_json, step=0)
  _copy_tokenizer(hf_dir, workdir)
  with open(os.path.join(workdir, SOURCE_CONFIG), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
  logging.info("Imported %s (%s) into %s at step 0.", hf_dir,
               hf_config["model_type"], workdir)
  return config


def _copy_tokenizer(source: str, target: str) -> None:
  """Copies the Hugging Face tokenizer files that `source` has."""
  for name in state_lib.HF_TOKENIZER_FILES:
    if os.path.isfile(os.path.join(source, name)):
      shutil.copyfile(os.path.join(source, name), os.path.join(target, name))


# What an export without a source checkpoint's tokenizer config says about
# its tokenizer.json, so that `transformers.AutoTokenizer` loads it.
_TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast",
                     "clean_up_tokenization_spaces": False}


def write_tokenizer(tok: Optional[state_lib.RunTokenizer], hf_dir: str
                    ) -> None:
  """Writes a run's tokenizer (`state.run_tokenizer`) beside an export: an
  imported checkpoint's files as they came (all of them from the folder
  of its `tokenizer.json`), the run's BPE or released tokenizer, or a
  byte-level `tokenizer.json` whose id b is byte b; nothing for token-id
  runs (None). Adds a `tokenizer_config.json` where none came, so that
  `transformers.AutoTokenizer` loads the folder."""
  if tok is None:
    logging.info("The run is on token ids: no tokenizer exported.")
    return
  target = os.path.join(hf_dir, state_lib.HF_TOKENIZER_FILES[0])
  if tok.released and os.path.basename(tok.path) == (
      state_lib.HF_TOKENIZER_FILES[0]):
    _copy_tokenizer(os.path.dirname(tok.path), hf_dir)
  elif tok.path:
    shutil.copyfile(tok.path, target)
  else:
    tokenizer_lib.write(tokenizer_lib.bytes_tokenizer(), target)
  config_path = os.path.join(hf_dir, state_lib.HF_TOKENIZER_FILES[1])
  if not os.path.isfile(config_path):
    with open(config_path, "w") as f:
      json.dump(_TOKENIZER_CONFIG, f, indent=2)


def export_checkpoint(workdir: str, hf_dir: str, *,
                      max_shard_size: Union[int, str] = "5GB",
                      model_type: Optional[str] = None) -> Any:
  """Writes the newest parameters of `workdir` as a checkpoint directory.

  Returns:
    The run (`state.load_run`) that was exported.

  Raises:
    FileNotFoundError: no run or no checkpoint in `workdir`.
    ValueError: the format cannot express the run's model (see
      `save_pretrained`).
  """
  run = state_lib.load_run(workdir)
  source = None
  source_path = os.path.join(run.workdir, SOURCE_CONFIG)
  if os.path.isfile(source_path):
    with open(source_path) as f:
      source = json.load(f)
  convert.save_pretrained(run.model, run.params, hf_dir,
                          max_shard_size=max_shard_size,
                          model_type=model_type, source_config=source)
  write_tokenizer(state_lib.run_tokenizer(run), hf_dir)
  logging.info("Exported %s (step %d) to %s.", run.workdir, run.step, hf_dir)
  return run
