"""Tests of kda_lm/flops.py: parameter counts, step FLOPs, device peaks."""

import helpers
import jax
import numpy as np
import pytest

from kda_lm import flops, model, stack


@pytest.mark.parametrize("kind,tflops", [
    ("TPU v5 lite", 197), ("TPU v5", 459), ("TPU v5p", 459),
    ("TPU v6 lite", 918), ("TPU v4", 275), ("NVIDIA H100 80GB HBM3", 989),
    ("NVIDIA H100 PCIe", 756), ("NVIDIA H200", 989), ("NVIDIA B200", 2250),
    ("cpu", None), ("NVIDIA A100-SXM4-80GB", None)])
def test_peak_flops_by_device_kind(kind, tflops):
  peak = flops.peak_flops(kind)
  assert peak == (None if tflops is None else tflops * 1e12)


def test_counts_from_either_layout_and_activated_experts():
  """The same counts from the traced parameters, the unscanned and the
  scanned layout; activated = all but the embedding, and k of E routed
  experts."""
  moe = dict(attention_pattern="KMKMKM", num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=16,
             first_k_dense_replace=2)
  cfg = helpers.tiny_model(**moe)
  traced = flops.count_params(cfg)
  params = model.abstract_params(cfg)
  assert flops.count_params(cfg, params) == traced
  scanned_cfg = helpers.tiny_model(**moe, scan_layers=True)
  scanned = stack.to_scanned(
      jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), params), scanned_cfg)
  assert flops.count_params(scanned_cfg, scanned) == traced
  leaves = {(m, n): p.size for m, e in params.items() for n, p in e.items()}
  embed = sum(v for (m, _), v in leaves.items() if m == "embed")
  routed = sum(v for (m, n), v in leaves.items()
               if m.endswith("/moe") and n in ("gate_proj", "up_proj",
                                               "down_proj"))
  assert routed and traced["total"] == sum(leaves.values())
  assert traced["activated"] == traced["total"] - embed - routed // 2


def test_step_flops_scale_with_rows_and_grow_with_t():
  cfg = helpers.tiny_model(attention_pattern="KM")
  one = flops.step_flops(cfg, 1, 64)
  assert flops.step_flops(cfg, 3, 64) == pytest.approx(3 * one)
  # Causal MLA grows faster than linearly in T; the rest is linear.
  assert flops.step_flops(cfg, 1, 128) > 2 * one
  activated = flops.count_params(cfg)["activated"]
  assert one > 6 * activated * 64


def test_step_flops_count_every_head_and_the_mtp_layers():
  """The LM head runs for the main output and each MTP layer; an MTP layer
  costs its parameters and its attention core; a tied head (the
  embedding table) costs what an untied one does."""
  B, T = 2, 64
  base = helpers.tiny_model(attention_pattern="KM")
  with_mtp = dict(attention_pattern="KM", num_mtp_layers=1,
                  mtp_layer_kind="M")
  mtp = helpers.tiny_model(**with_mtp)
  only_m = helpers.tiny_model(attention_pattern="M")
  mla_core = (flops.step_flops(only_m, B, T)
              - 6 * flops.count_params(only_m)["activated"] * B * T)
  head = mtp.d_model * mtp.vocab_size
  want = 6 * (flops.count_params(mtp)["mtp_activated"] + head) * B * T
  assert flops.step_flops(mtp, B, T) - flops.step_flops(base, B, T) == (
      pytest.approx(want + mla_core))
  tied = helpers.tiny_model(**with_mtp, tie_embeddings=True)
  assert flops.step_flops(tied, B, T) == pytest.approx(
      flops.step_flops(mtp, B, T))
