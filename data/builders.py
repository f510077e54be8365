"""What the local TFDS builders (`delayed_copy`, `text_files`) share."""

import inspect
from typing import Any

from absl import logging
from etils import epath
import tensorflow_datasets as tfds


def tensor(dtype: Any) -> tfds.features.Tensor:
  """A variable-length 1-D feature stored as raw bytes."""
  return tfds.features.Tensor(shape=(None,), dtype=dtype,
                              encoding=tfds.features.Encoding.BYTES)


class LocalBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A builder generated offline from local code; subclasses give
  `_features` and the generators."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # TFDS's own lookup needs the `importlib_resources` backport for modules
    # inside a package; the file path is all it uses it for.
    return epath.Path(inspect.getfile(cls))

  def _features(self) -> dict[str, Any]:
    raise NotImplementedError

  # TFDS prints "Downloading and preparing dataset ..." in bold before any
  # build; these builders download nothing, so they say what they do.
  def _log_download_bytes(self) -> None:
    logging.info("Building the dataset %s from local files in %s (once "
                 "per data dir; nothing is downloaded).", self.name,
                 self.data_dir)

  def _log_download_done(self) -> None:
    logging.info("Built the dataset %s in %s.", self.name, self.data_dir)

  def _info(self) -> tfds.core.DatasetInfo:
    module = inspect.getmodule(type(self))
    return tfds.core.DatasetInfo(
        builder=self,
        description=module.__doc__.split("\n\n")[1],
        features=tfds.features.FeaturesDict(self._features()),
    )
