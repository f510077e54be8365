"""Inference: decoding, generation and evaluation of a trained run.

* `decoding`: the jitted prefill and decode step of the one decoder
  (`kda_lm.model`), sampling, and the generation loop.
* `generate`: `python -m kda_lm.infer.generate`, samples and copy accuracy.
* `evaluate`: `python -m kda_lm.infer.evaluate`, validation loss per
  document and packed, per token and per byte.

May import: `data`, `config`, `model`, `losses`, `layers`,
`kda_lm.checkpoint`, `kda_lm.train.state` (to load a run). Never the rest
of `kda_lm.train`.
"""
