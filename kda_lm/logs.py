"""The library's log filter: INFO lines of Orbax, TF, TFDS and JAX off.

`quiet_library_logs` keeps a tool's output readable (`train.py`,
`kda_lm.infer.generate`, `kda_lm.infer.evaluate`, `python -m kda_lm.hf`):
it drops those libraries' INFO logs and TFDS's routine warnings, keeps
their errors and other warnings, and sends Orbax's tracebacks of a failed
background save to the debug log (`--verbosity=1` shows it all).
"""

import logging as std_logging

from absl import logging

# Libraries whose INFO logs `quiet_library_logs` drops (warnings stay), and
# TFDS, whose routine warnings on every load ("Using custom data
# configuration", deprecations) are dropped too (errors stay).
_CHATTY_LIBRARIES = ("/orbax/", "/tensorflow/", "/tensorflow_datasets/",
                     "/jax/")
_CHATTY_WARNINGS = ("/tensorflow_datasets/",)


class _LibraryInfoFilter(std_logging.Filter):

  def filter(self, record: std_logging.LogRecord) -> bool:
    path = record.pathname
    if record.exc_info and "/orbax/" in path:
      # A failed background save's traceback, logged by Orbax's threads:
      # the run stops with one `CheckpointSaveError` line, and the
      # traceback is kept for the debug log (--verbosity=1).
      if not logging.get_absl_logger().isEnabledFor(std_logging.DEBUG):
        return False
      record.levelno, record.levelname = std_logging.DEBUG, "DEBUG"
      return True
    if record.levelno >= std_logging.ERROR:
      return True
    if record.levelno >= std_logging.WARNING:
      return not any(lib in path for lib in _CHATTY_WARNINGS)
    return not any(lib in path for lib in _CHATTY_LIBRARIES)


def quiet_library_logs() -> None:
  """Drops INFO logs of Orbax, TF, TFDS and JAX, and TFDS warnings; Orbax's
  tracebacks go to the debug log."""
  logger = logging.get_absl_logger()
  if not any(isinstance(f, _LibraryInfoFilter) for f in logger.filters):
    logger.addFilter(_LibraryInfoFilter())
