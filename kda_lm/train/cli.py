"""Command-line helpers of `train.py`: a bad `--config.` flag in one line.

ml_collections reports an unknown config key from inside absl's flag
parsing as a chained traceback of some 55 lines whose useful part, its
"Did you mean" suggestion, comes last. `parse_flags` (absl's
`flags_parser`; with the default config file the overrides are applied
while the flag is defined, where `exit_on_bad_flag` does the same)
prints one line instead, naming the whole key and the
suggested one, and exits with status 2 (a usage error); with
`--verbosity` above 0 the traceback is kept.
"""

import os
import re
import sys
from typing import Sequence

from absl import flags

USAGE_EXIT = 2
_SUGGESTION = re.compile(r'Did you mean "([^"]+)" instead of "([^"]+)"')
_KEY = re.compile(r"'(\w+)")


def config_flag_message(error: BaseException, argv: Sequence[str]) -> str:
  """One line for a failed `--config.` override: the flag's whole key and,
  where ml_collections has one, the key it probably meant."""
  text = str(error).replace("\\n", "\n").replace("\\'", "'")
  suggestion = _SUGGESTION.search(text)
  key = suggestion.group(2) if suggestion else (
      _KEY.search(text).group(1) if isinstance(error, (KeyError,
                                                       AttributeError))
      and _KEY.search(text) else None)
  for arg in argv:
    if key is None or not arg.startswith("--config."):
      continue
    path = arg[2:].split("=", 1)[0]
    parts = path.split(".")
    if key in parts:
      line = f"unknown config key {path}"
      if suggestion:
        parts[parts.index(key)] = suggestion.group(1)
        line += f"; did you mean {'.'.join(parts)}?"
      return line
  first = text.strip().splitlines()[0]
  return f"bad command-line flag: {first}"


BAD_FLAG_ERRORS = (AttributeError, KeyError, TypeError, ValueError,
                   flags.Error)


def exit_on_bad_flag(error: BaseException, argv: Sequence[str]) -> None:
  """Prints `config_flag_message` and exits 2; re-raises the error with
  `--verbosity` above 0 (the traceback asked for)."""
  if any(a.startswith(("--verbosity", "-v=", "--v=")) and not a.endswith(
      ("=0", "=-1", "=-2", "=-3")) for a in argv):
    raise error
  print(f"{os.path.basename(argv[0])}: {config_flag_message(error, argv)}",
        file=sys.stderr)
  sys.exit(USAGE_EXIT)


def parse_flags(argv: Sequence[str]) -> list[str]:
  """absl's flag parsing, with a bad flag reported in one line (exit 2)."""
  try:
    return flags.FLAGS(argv)
  except BAD_FLAG_ERRORS as error:
    exit_on_bad_flag(error, argv)
