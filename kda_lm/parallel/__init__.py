"""Parallelism: the device mesh, shardings, per-device kernels, processes.

* `sharding`: the (`data`, `fsdp`, `expert`, `context`) mesh, parameter
  and batch shardings (routed experts over `expert`), the batch-shape and
  expert-axis checks.
* `maps`: the calls per device under the mesh (`jax.shard_map` over the
  row axes) and the mesh queries: the MoE token map, the expert-parallel
  map and its exchanges (padded or ragged), the LM head and loss summed
  over the devices' rows.
* `context`: context parallelism: KDA with its state carried across
  `context` shards, the short convolution's halo, MLA's gathered keys.
  `maps` and `context` are the layers' entries into this room.
* `distributed`: multi-host start-up and process ordering.

May import: `kda_lm.config`, `kda_lm.segments`, `kda_lm.ops`. Never
`kda_lm.layers`, `model`, `checkpoint`, `train` or `infer`.
"""
