"""Parallelism: the device mesh, shardings, per-device kernels, processes.

* `sharding`: the (`data`, `fsdp`, `expert`, `context`) mesh, parameter
  and batch shardings (routed experts over `expert`), the batch-shape and
  expert-axis checks.
* `context`: running the kernels and sorts per device under the mesh
  (`jax.shard_map`): KDA with its state carried across `context` shards,
  the short convolution's halo, the MoE token map and the expert-parallel
  exchange. The layers' one entry into this room.
* `distributed`: multi-host start-up and process ordering.

May import: `kda_lm.config`, `kda_lm.segments`, `kda_lm.ops`. Never
`kda_lm.layers`, `model`, `checkpoint`, `train` or `infer`.
"""
