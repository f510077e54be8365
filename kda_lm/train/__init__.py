"""Training: the train state, the jitted steps, the loop, and its output.

* `state`: `TrainState` and its one builder (`state_layout`: init,
  abstract shapes, shardings), a run's tokenizer, and `load_run` for
  inference. It imports nothing else of this room, and is the one module
  here that `kda_lm.infer` and `kda_lm.hf` may import.
* `step`: the loss, the update step (gradient, optimizer, MoE selection
  biases) and the eval loop over batches.
* `loop`: `train_and_evaluate` (set-up, resume, when to log, evaluate and
  save).
* `ahead`: the train and eval steps lowered, then compiled in background
  threads while the state is initialised or restored.
* `metrics`: `metrics.jsonl`, TensorBoard, the console progress, the
  averaging window of a log row.
* `preemption`: SIGTERM/SIGINT to a saved step and exit status 75 (all
  processes at one step), time-based checkpoints.

May import: `data`, every lower room of `kda_lm` (`config`, `model`,
`losses`, `optimizer`, `layers`, `parallel`, `checkpoint`). Never
`kda_lm.infer` or `kda_lm.hf`.
"""
