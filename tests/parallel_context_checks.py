"""Context-parallel equivalence checks, run in a subprocess with 8 fake CPU
devices by `parallel_context_test.py` (fake devices must be set before JAX
starts). Prints one JSON object of measured relative errors and errors.

Shapes are tiny (B=2, T=64..128, H=2, K=V=16, chunk 16) and every
compiled function serves several cases.
"""

import itertools
import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

import kda_lm  # noqa: E402,F401  (XLA flags)  # isort: skip
import haiku as hk  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from configs import ling3_tiny  # noqa: E402
from kda_lm import config as config_lib  # noqa: E402
from kda_lm import model as model_lib  # noqa: E402
from kda_lm.layers import conv, mla  # noqa: E402
from kda_lm.ops.kda import pallas  # noqa: E402
from kda_lm.parallel import context as context_parallel
from kda_lm.parallel import sharding
from testbed import kda_cases, numerics  # noqa: E402

T_OP = 128


def mesh(n):
  """A (data=1, fsdp=1, context=n) mesh over the first n devices."""
  config = ml_collections.ConfigDict(dict(data=1, fsdp=1, context=n))
  return sharding.make_mesh(config, jax.devices()[:n])


def op_ids():
  """[2,128] ids. Shard splits at 16k (n=8), 32k (n=4), 64 (n=2).

  Row 0: id 1 over 0..49 (spans shards 0-3 at n=8), id 2, id 3 starting
  exactly at the split 64, padding 70..95 (shard 5 at n=8 all padding), id
  3 reused after padding, one-token documents 101 and 102, id 6 to 111,
  trailing padding 112..127 (the last shard at n=8 all padding: the final
  state lies in an earlier shard). Row 1: leading padding (the initial
  state passes through an all-padding shard 0), then one long document.
  """
  ids = np.zeros((2, T_OP), np.int32)
  ids[0, 0:50], ids[0, 50:64], ids[0, 64:70] = 1, 2, 3
  ids[0, 96:101], ids[0, 101], ids[0, 102], ids[0, 103:112] = 3, 4, 5, 6
  ids[1, 21:] = 7
  return jnp.asarray(ids)


def op_errors(gate, shards, impl="xla"):
  """Relative errors of o, final state and each gradient vs n = 1.

  impl "pallas" runs the kernels in interpret mode with chunk size 64.
  """
  settings = dict(impl="xla", chunk_size=16)
  if impl == "pallas":
    settings = dict(impl="pallas", chunk_size=64,
                    pallas_options=pallas.for_platform("cpu"))
  rng = np.random.default_rng(0)
  params, static = kda_cases.kda_inputs(rng, 2, T_OP, 2, 16, 16, gate=gate,
                                        l2norm=True)
  do, dht = kda_cases.kda_cotangents(rng, (2, T_OP, 2, 16), 2, 16)
  ids = op_ids()

  def loss(p):
    o, state = context_parallel.chunk_kda(
        p["q"], p["k"], p["v"], p["g"], p["beta"], segment_ids=ids,
        initial_state=p["initial_state"], A_log=p.get("A_log"),
        dt_bias=p.get("dt_bias"), output_final_state=True, **settings,
        **static)
    return jnp.sum(o * do) + jnp.sum(state * dht), (o, state)

  step = jax.jit(jax.value_and_grad(loss, has_aux=True))
  results = {}
  for n in (1,) + shards:
    with jax.set_mesh(mesh(n)):
      results[n] = step(params)
  (_, (o1, s1)), g1 = results[1]
  out = {}
  for n in shards:
    (_, (o, s)), g = results[n]
    out[f"op_{impl}_{gate}_{n}"] = {
        "o": numerics.rel_err(o, o1), "final_state": numerics.rel_err(s, s1),
        **{f"d{k}": numerics.rel_err(g[k], g1[k]) for k in g1}}
  return out


def keep_state_reference(ids_BT, n):
  """[n,B] numpy: whether shard j starts from the state entering it, from
  the segment rule alone (`kda_lm/segments.py`: a state reset before every
  segment start but the row's first; padding changes no state).

  A shard without a real token passes the state through (1); otherwise it
  keeps it iff no reset falls on its first real token.
  """
  B, T = ids_BT.shape
  prev = np.concatenate([np.full((B, 1), -1), ids_BT[:, :-1]], axis=1)
  seg_start = (ids_BT != prev) & (ids_BT != 0)
  resets = seg_start & (np.cumsum(seg_start, axis=1) > 1)
  keep = np.ones((n, B), np.float32)
  for j in range(n):
    shard = slice(j * T // n, (j + 1) * T // n)
    for b in range(B):
      real = np.flatnonzero(ids_BT[b, shard])
      if real.size and resets[b, shard][real[0]]:
        keep[j, b] = 0.0
  return keep


def keep_ids():
  """[3,64] ids for the op at n = 4 (shards of 16), the layouts where the
  state exchange must reset or carry at a shard boundary.

  Row 0: document 1, padding 12..19 across the split 16 (shard 1 begins
  with padding after shard 0 ended with it), then a new document 2 inside
  shard 1 (a reset); padding 30..35 across the split 32, then id 2 reused
  (a new piece: a reset); id 3 from 44 on, continued across the split 48
  (the state carries). Row 1: padding up to 40 (shards 0 and 1 all
  padding, shard 2 begins with padding), then the row's first document:
  the initial state passes through. Row 2: document 1, shard 1 all padding,
  id 1 reused in shard 2 (a reset), shard 3 all padding (the final state
  lies in shard 2).
  """
  ids = np.zeros((3, 64), np.int32)
  ids[0, 0:12], ids[0, 20:30], ids[0, 36:44], ids[0, 44:] = 1, 2, 2, 3
  ids[1, 40:] = 5
  ids[2, 0:10], ids[2, 40:48] = 1, 1
  return ids


def keep_state(ids_BT, n):
  """`context_parallel._keep_state` on [B,T] ids split over n shards."""
  P = jax.sharding.PartitionSpec
  return np.asarray(jax.jit(jax.shard_map(
      context_parallel._keep_state,  # pylint: disable=protected-access
      mesh=mesh(n), in_specs=P(None, context_parallel.CONTEXT_AXIS),
      out_specs=P(), check_vma=False))(ids_BT))


def keep_errors():
  """`context_parallel._keep_state` against `keep_state_reference` on every
  row of ids in {0, 1, 2} (3^T rows) at several shard counts and on
  `keep_ids`, and the op at n = 4 against one device on `keep_ids`."""
  out = {}
  for n, T in ((2, 6), (3, 6), (4, 8)):
    ids = np.array(list(itertools.product(range(3), repeat=T)), np.int32)
    keep, want = keep_state(ids, n), keep_state_reference(ids, n)
    bad = np.flatnonzero(np.any(keep != want, axis=0))
    out[f"keep_state_{n}"] = {
        "rows": len(ids), "mismatches": int(bad.size),
        "example": None if not bad.size else {
            "ids": ids[bad[0]].tolist(), "keep": keep[:, bad[0]].tolist(),
            "want": want[:, bad[0]].tolist()}}
  ids = keep_ids()
  out["keep_state_ids"] = {"mismatches": int(np.sum(
      keep_state(ids, 4) != keep_state_reference(ids, 4)))}
  params, static = kda_cases.kda_inputs(np.random.default_rng(3), 3, 64, 2,
                                        16, 16, gate="safe", l2norm=True)

  def op(p):
    return context_parallel.chunk_kda(
        p["q"], p["k"], p["v"], p["g"], p["beta"],
        segment_ids=jnp.asarray(ids), initial_state=p["initial_state"],
        A_log=p["A_log"], dt_bias=p["dt_bias"], output_final_state=True,
        impl="xla", chunk_size=16, **static)

  results = {}
  for n in (1, 4):
    with jax.set_mesh(mesh(n)):
      results[n] = jax.jit(op)(params)
  (o1, s1), (o4, s4) = results[1], results[4]
  out["keep_op_4"] = {"o": numerics.rel_err(o4, o1),
                      "final_state": numerics.rel_err(s4, s1)}
  return out


def layer_inputs(T=64):
  """[2,T] ids (a document starting exactly at the split T/2 and at T/4,
  padding inside a row) and [2,T,24] inputs."""
  ids = np.zeros((2, T), np.int32)
  ids[0, :20], ids[0, 20:32], ids[0, 32:40], ids[0, 44:60] = 1, 2, 3, 3
  ids[1, 3:], ids[1, 16] = 5, 6
  x = np.random.default_rng(1).standard_normal((2, T, 24))
  return jnp.asarray(ids), jnp.asarray(x.astype(np.float32))


def layer_errors(name, build, shards=(4,), T=64):
  """Output and gradient (params and input) errors of a layer at each
  shard count vs 1 device; cases named `name_n` (`name` for n = 4)."""
  ids, x = layer_inputs(T)
  f = hk.without_apply_rng(hk.transform(lambda x, ids: build()(x, ids)))
  params = f.init(jax.random.PRNGKey(0), x, ids)
  weight = jnp.sin(jnp.arange(x.shape[0] * x.shape[1] * 24.0))

  def loss(p, x):
    y = f.apply(p, x, ids)
    return jnp.sum(y * weight.reshape(y.shape)), y

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  res = {}
  for m in (1,) + tuple(shards):
    with jax.set_mesh(mesh(m)):
      res[m] = step(params, x)
  (_, y1), g1 = res[1]
  out = {}
  for n in shards:
    (_, y), g = res[n]
    out[name if n == 4 else f"{name}_{n}"] = {
        "y": numerics.rel_err(y, y1), "grads": max(
            numerics.rel_err(a, b) for a, b in zip(
                jax.tree.leaves(g), jax.tree.leaves(g1), strict=True))}
  return out


def tiny_model():
  """ling3_tiny's layers at tiny widths, two of them: KDA with the dense
  feed-forward, then MLA with the MoE; the MTP block."""
  m = ling3_tiny.get_config().model
  for key, value in dict(attention_pattern="KM", d_model=32, num_heads=2,
                         head_dim=16, kv_lora_rank=16, qk_nope_head_dim=8,
                         qk_rope_head_dim=8, v_head_dim=8, mlp_hidden_dim=64,
                         moe_intermediate_size=16, num_experts=4,
                         vocab_size=32, kda_chunk_size=16,
                         num_mtp_layers=1).items():
    m[key] = value
  return model_lib.build(config_lib.ModelConfig.from_config(m))


def model_errors(n=4):
  """Logits (main and MTP) and parameter gradients at n vs 1; each
  document of a packed row against the same document alone in a row of
  padding."""
  ids, _ = layer_inputs()
  model = tiny_model()
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 32, ids.shape),
                       jnp.int32)
  params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens, ids)

  def loss(p, tokens, ids):
    logits, aux = model.apply(p, tokens, ids, return_aux=True)
    logp = (jax.nn.log_softmax(logits)[..., 0]
            + 0.1 * jax.nn.log_softmax(aux["mtp_logits"][0])[..., 0])
    return jnp.sum(logp * (ids != 0)) / jnp.sum(ids != 0), (
        logits, aux["mtp_logits"])

  step = jax.jit(jax.value_and_grad(loss, has_aux=True))
  res = {}
  for m in (1, n):
    with jax.set_mesh(mesh(m)):
      res[m] = step(params, tokens, ids)
  (_, l1), g1 = res[1]
  (_, ln), gn = res[n]
  out = {"logits": max(numerics.rel_err(a, b)
                       for a, b in zip(ln, l1, strict=True)), "grads": max(
      numerics.rel_err(a, b)
      for a, b in zip(jax.tree.leaves(gn), jax.tree.leaves(g1), strict=True))}
  # Row 0's documents one at a time, each at the start of a padded row.
  alone, spans = [], []
  for doc in (1, 2):
    where = np.flatnonzero(np.asarray(ids[0]) == doc)
    alone_ids = np.zeros(ids.shape[1], np.int32)
    alone_ids[:where.size] = doc
    alone_tok = np.zeros(ids.shape[1], np.int32)
    alone_tok[:where.size] = np.asarray(tokens[0, where])
    alone.append((alone_tok, alone_ids))
    spans.append(where)
  with jax.set_mesh(mesh(n)):
    (_, la), _ = step(params, jnp.asarray(np.stack([a[0] for a in alone])),
                      jnp.asarray(np.stack([a[1] for a in alone])))
  # Main logits [B,T,W] and MTP logits [1,B,T,W].
  out["documents"] = max(
      numerics.rel_err(a[..., i, :w.size, :], b[..., 0, w, :])
      for a, b in zip(la, ln, strict=True) for i, w in enumerate(spans))
  return {"model": out}


def refusals():
  """Error messages of inputs context parallelism refuses."""
  out = {}
  x = jnp.zeros((2, 34, 2, 16))
  cases = {
      "t_not_divisible": lambda: context_parallel.chunk_kda(
          x, x, x, x, x[..., 0], impl="xla"),
      "cu_seqlens": lambda: context_parallel.chunk_kda(
          x[:1, :32], x[:1, :32], x[:1, :32], x[:1, :32], x[:1, :32, :, 0],
          cu_seqlens=np.array([0, 16, 32])),
      "short_shard": lambda: hk.transform(
          lambda: conv.ShortConvolution(8)(jnp.zeros((2, 16, 4)))).init(
              jax.random.PRNGKey(0)),
  }
  for name, fn in cases.items():
    try:
      with jax.set_mesh(mesh(4)):
        fn()
      out[name] = None
    except ValueError as e:
      out[name] = str(e)
  return {"refusals": out}


def main():
  # Tiny shapes: compilation dominates, so skip most XLA optimizations.
  jax.config.update("jax_disable_most_optimizations", True)
  which = sys.argv[1]
  out = {}
  if which == "op":
    out.update(op_errors("safe", (4, 8)))
    out.update(op_errors("pre", (2,)))
    out.update(op_errors("safe", (2,), impl="pallas"))
  elif which == "keep":
    out.update(keep_errors())
  elif which == "layers":
    out.update(layer_errors("conv", lambda: conv.ShortConvolution(
        4, with_bias=True)))
    build_mla = lambda: mla.MultiHeadLatentAttention(
        2, q_lora_rank=8, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, output_gate=True, q_block=8)
    # Balanced pieces (even T/n: 32, 16 and 8 tokens per shard), then the
    # contiguous layout (T/n = 17 tokens).
    out.update(layer_errors("mla", build_mla, shards=(2, 4, 8)))
    out.update(layer_errors("mla_odd", build_mla, T=68))
  else:
    out.update(model_errors())
    out.update(refusals())
  print(json.dumps(out))


if __name__ == "__main__":
  main()
