"""Checkpoint paths: a local directory or an object store URL (`gs://`).

`manager` and `manifest` reach a checkpoint's files through `etils.epath`
(as Orbax does), which serves local disks and Cloud Storage alike. What
differs between the two lives here: a local path is made absolute, a URL is
kept as given; the local tree is walked and sized with the OS's calls.
"""

import os
import re
from typing import Iterator

from etils import epath

# `gs://`, `s3://`, ...: a URL scheme (RFC 3986) before `://`.
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_remote(path: epath.PathLike) -> bool:
  """Whether `path` is a URL such as `gs://bucket/run`, not a local path."""
  return bool(_SCHEME.match(os.fspath(path)))


def absolute(path: epath.PathLike) -> str:
  """`path` as a string: a local one absolute with `~` expanded, a URL as
  given."""
  path = os.fspath(path)
  if is_remote(path):
    return path
  return os.path.abspath(os.path.expanduser(path))


def has_entries(directory: epath.PathLike) -> bool:
  """Whether `directory` (local or a URL) exists and holds anything."""
  path = epath.Path(directory)
  return path.is_dir() and any(path.iterdir())


def size(path: epath.Path) -> int:
  """A file's bytes.

  A local file's come from `os.stat`: epath's `stat` also looks up the
  owner's user name, which fails for a user id without one (as in some
  containers).
  """
  if is_remote(path):
    return path.stat().length
  return os.stat(path).st_size


def files(root: epath.PathLike) -> Iterator[tuple[str, epath.Path]]:
  """Every file under `root`, with its `/`-separated path relative to it.

  Walks with `iterdir` (an object store's `walk` names directories without
  the URL scheme). A directory that vanishes while it is walked is skipped,
  as `os.walk` does.

  Args:
    root: the directory.

  Yields:
    `(relative path, path)` pairs, in no particular order.
  """
  pending = [(epath.Path(root), "")]
  while pending:
    directory, prefix = pending.pop()
    try:
      children = list(directory.iterdir())
    except FileNotFoundError:
      continue
    for child in children:
      rel = prefix + child.name
      if child.is_dir():
        pending.append((child, rel + "/"))
      else:
        yield rel, child
