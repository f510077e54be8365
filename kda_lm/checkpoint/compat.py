"""Whether a checkpoint's parameters fit the model: names, shapes, dtypes.

Checked from the checkpoint's metadata before any array is read, so a
checkpoint of another model config is refused with the first parameter
that differs, not with an error from deep inside Orbax.
"""

from typing import Any

import jax
import numpy as np

from kda_lm import stack


class IncompatibleCheckpointError(ValueError):
  """A checkpoint does not match the model being trained."""


def _leaf_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  """Maps `a/b/c` paths of a (metadata) tree to (shape, dtype)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: x is None)
  shapes = {}
  for path, leaf in flat:
    if leaf is None or not hasattr(leaf, "shape"):
      continue
    name = "/".join(
        str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
        for k in path)
    shapes[name] = (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
  return shapes


def check_compatible(saved_params: Any, target_params: Any, *,
                     where: str = "the checkpoint") -> None:
  """Raises if the saved parameters do not match the target's shapes.

  Args:
    saved_params: parameter tree from the checkpoint metadata (leaves with
      `shape` and `dtype`).
    target_params: the model's parameter tree (arrays or
      `jax.ShapeDtypeStruct`s).
    where: how to name the checkpoint in the message.

  Raises:
    IncompatibleCheckpointError: a parameter is missing, extra, or has a
      different shape or dtype; the message names the first such parameter.
  """
  saved = _leaf_shapes(saved_params)
  target = _leaf_shapes(target_params)
  hint = (" The checkpoint comes from a different model config: use another "
          "--workdir, or delete the checkpoints to start afresh.")
  scanned = [any(name.split("/", 2)[1:2] == [stack.SCAN_NAME]
                 or name.startswith(stack.SCAN_NAME + "/") for name in tree)
             for tree in (saved, target)]
  if scanned[0] != scanned[1]:
    hint = (f" The checkpoint's layers are "
            f"{'' if scanned[0] else 'not '}scanned: resume with "
            f"--config.model.scan_layers={scanned[0]}, or convert its "
            "parameters with kda_lm.stack.to_layout.")
  for name in sorted(target):
    if name not in saved:
      raise IncompatibleCheckpointError(
          f"Incompatible checkpoint {where}: the model has parameter {name!r} "
          f"{target[name][0]} that the checkpoint lacks.{hint}")
    if saved[name] != target[name]:
      raise IncompatibleCheckpointError(
          f"Incompatible checkpoint {where}: parameter {name!r} has shape "
          f"{saved[name][0]} ({saved[name][1]}) in the checkpoint but "
          f"{target[name][0]} ({target[name][1]}) in the model.{hint}")
  extra = sorted(set(saved) - set(target))
  if extra:
    raise IncompatibleCheckpointError(
        f"Incompatible checkpoint {where}: it has parameter {extra[0]!r} "
        f"{saved[extra[0]][0]} that the model lacks.{hint}")
