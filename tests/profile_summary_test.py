"""Tests for testbed/profile_summary.py: parts of a profiled program."""

import jax
import jax.numpy as jnp

from testbed import profile_summary


def test_part_of_reads_scopes_inside_transformations():
  assert profile_summary.part_of(
      "jit(update)/transpose(jvp(layer_0))/kda/o_proj/dot_general"
  ) == "KDA mixer"
  assert profile_summary.part_of(
      "jit(update)/jvp(loss)/while/body/closed_call/dot_general"
  ) == "head and loss"
  assert profile_summary.part_of(
      "jit(update)/jvp(layer_1)/moe/router/logistic") == "MoE router"
  assert profile_summary.part_of("jit(update)/optimizer/add") == "optimizer"
  # A module whose name merely contains a part's name is not that part.
  assert profile_summary.part_of("jit(f)/kda_extra/add") == "other"


def test_hlo_instructions_reads_opcodes_and_op_names():
  text = ('  %fusion.3 = f32[4]{0} fusion(f32[4]{0} %p), kind=kLoop, '
          'calls=%fused, metadata={op_name="jit(f)/jvp(loss)/exp"}\n'
          '  ROOT %while.2 = (s32[]{:T(128)}, /*index=1*/f32[2]{0}) '
          'while((s32[], f32[2]) %t), condition=%c, body=%b\n')
  got = profile_summary.hlo_instructions(text)
  assert got == {"fusion.3": ("fusion", "jit(f)/jvp(loss)/exp"),
                 "while.2": ("while", "")}


def test_profile_attributes_device_time_to_named_scopes():
  def f(x):
    with jax.named_scope("loss"):
      y = jnp.tanh(x @ x)
    with jax.named_scope("optimizer"):
      return jnp.sum(y @ y)

  x = jnp.ones((256, 256))
  compiled = jax.jit(f).lower(x).compile()
  rows, _ = profile_summary.profile(compiled, (x,), steps=2)
  parts = {part: sec for part, sec, _ in rows}
  assert parts.get("head and loss", 0) > 0
  assert parts.get("optimizer", 0) > 0
  # No container (while, call) is counted beside its children.
  for _, _, top in rows:
    for op, _ in top:
      assert "(while)" not in op and "(call)" not in op
  assert "| head and loss |" in profile_summary.table(rows, 1.0)


def test_event_names_are_instruction_names_or_whole_hlo_lines():
  pattern = profile_summary._EVENT
  assert pattern.match("fusion.3").group(1) == "fusion.3"
  assert pattern.match("%while.328 = (s32[]{:T(128)}) while(%t), "
                       "condition=%c").group(1) == "while.328"
