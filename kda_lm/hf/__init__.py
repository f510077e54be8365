"""Hugging Face interop: `bailing_hybrid` (Ling 3.0) and `kimi_linear`
(Kimi Linear) checkpoints in and out.

* `convert`: `load_pretrained(path) -> (ModelConfig, params)` and
  `save_pretrained(model_config, params, path)`.
* `formats`: `config.json` <-> the `model` section, and what each format
  cannot express.
* `mapping`: checkpoint tensor names <-> the parameter tree (unscanned).
* `safetensors_io`: reading and writing safetensors, one tensor at a time.
* `workdir`: a checkpoint directory <-> a run directory (step-0 checkpoint
  written through `kda_lm.checkpoint`, the model's `tokenizer.json`).
* `__main__`: `python -m kda_lm.hf import|export`.

May import: `kda_lm.config`, `model`, `layers`, `kda_lm.parallel`,
`kda_lm.checkpoint`, `kda_lm.train.state` (the train state and its
builder, `load_run`), `data`. Sits beside `kda_lm.train` and
`kda_lm.infer`: neither imports it, and of the two it imports only
`kda_lm.train.state`.
"""

from kda_lm.hf.convert import load_pretrained, save_pretrained

__all__ = ["load_pretrained", "save_pretrained"]
