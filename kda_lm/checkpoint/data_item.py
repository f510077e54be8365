"""The data item of a checkpoint: the training data iterator's position.

A small Orbax handler that calls the iterator's own `save(dir)` and
`restore(dir)` (a `tf.train.Checkpoint` of the tf.data iterator, one file
set per process), so a resume continues the stream where it stopped.
"""

import dataclasses
import os
from typing import Any, Protocol

from etils import epath
import orbax.checkpoint as ocp


class SavableIterator(Protocol):
  """What the data item needs: `save(dir)` and `restore(dir)`."""

  def save(self, directory: str) -> Any:
    ...

  def restore(self, directory: str) -> None:
    ...


class DataIteratorHandler(ocp.CheckpointHandler):
  """Orbax handler that saves/restores an iterator with `save`/`restore`."""

  def save(self, directory: epath.Path, args: "DataIteratorArgs") -> None:
    args.iterator.save(os.fspath(directory))

  def restore(self, directory: epath.Path,
              args: "DataIteratorArgs | None" = None) -> Any:
    if args is None:
      raise ValueError("Restoring the data iterator needs the iterator.")
    args.iterator.restore(os.fspath(directory))
    return args.iterator

  def metadata(self, directory: epath.Path) -> None:
    del directory
    return None

  def finalize(self, directory: epath.Path) -> None:
    del directory


@ocp.args.register_with_handler(DataIteratorHandler, for_save=True,
                                for_restore=True)
@dataclasses.dataclass
class DataIteratorArgs(ocp.args.CheckpointArgs):
  """Save/restore arguments of the data item: the iterator itself."""
  iterator: SavableIterator
