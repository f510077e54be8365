"""A training run on disk: what training writes and inference reads back.

* `workdir`: the run directory's layout (`config.json`, `checkpoints/`),
  the one-trainer lock, and the resume check of a saved config.
* `manager`: Orbax checkpoints of the training state and the data
  iterator (async save, restore with fallback, compatibility check).
* `manifest`: per-step file sizes and SHA-256, written and verified.
* `paths`: local paths and `gs://` URLs, reached through `etils.epath`.
* `compat`: whether a checkpoint's parameters fit the model.
* `data_item`: the Orbax handler of the data iterator's position.
* `state`: `TrainState`, its initialisation and abstract shapes, and
  `load_run` for inference (the typed run config is `kda_lm.config`'s).

May import: `data`, `kda_lm.config`, `model`, `optimizer`,
`kda_lm.parallel`. Never `kda_lm.train` or `kda_lm.infer` (both import
this room).
"""
