"""A training run on disk: what training writes and inference reads back.

* `workdir`: the run directory's layout (`config.json`, `checkpoints/`),
  the one-trainer lock, and the resume check of a saved config.
* `manager`: Orbax checkpoints of the training state and the data
  iterator (async save, restore with fallback, compatibility check).
* `manifest`: per-step file sizes and SHA-256, written and verified.
* `paths`: local paths and `gs://` URLs, reached through `etils.epath`.
* `compat`: whether a checkpoint's parameters fit the model.
* `data_item`: the Orbax handler of the data iterator's position.

The train state these checkpoints hold, and `load_run`, live in
`kda_lm.train.state`, which imports this room.

May import: `data`, every lower room of `kda_lm` (it uses `config`,
`stack` and `kda_lm.parallel`). Never `kda_lm.train` (its `state` module
included), `kda_lm.infer` or `kda_lm.hf` (all three import this room).
"""
