"""Reading a ConfigDict section into a frozen dataclass: the one reader of
every config section (`data`'s settings here, the model's and the
training's in `kda_lm/config.py`, which imports these names).

A section's dataclass fields are its keys (a field with `NOT_A_KEY`
metadata is not one), their defaults are the one home of the defaults;
`from_config` reads a ConfigDict into the dataclass, whose `__post_init__`
validates it, and `config_dict` gives a ConfigDict of the defaults. This
module imports nothing from the rest of the project.
"""

import dataclasses
import functools
import typing
from typing import Any, TypeVar

import ml_collections

T = TypeVar("T")


@functools.lru_cache(maxsize=None)
def _field_type(cls: type, name: str) -> type:
  """The scalar type of a field (`int` for `Optional[int]`)."""
  hint = typing.get_type_hints(cls)[name]
  args = [a for a in typing.get_args(hint) if a is not type(None)]
  return args[0] if args else hint


def config_dict(cls: type) -> ml_collections.ConfigDict:
  """A ConfigDict with every field of `cls` at its default.

  Fields without a default, or with None, become typed
  `FieldReference(None)`s, so that a config file or the command line can set
  them; a field whose type is a dataclass becomes a nested ConfigDict (a
  sub-section, e.g. `model.rope_scaling`).
  """
  out = ml_collections.ConfigDict()
  for f in _key_fields(cls):
    if dataclasses.is_dataclass(_field_type(cls, f.name)):
      out[f.name] = config_dict(_field_type(cls, f.name))
      continue
    value = f.default
    if value is dataclasses.MISSING or value is None:
      value = ml_collections.FieldReference(
          None, field_type=_field_type(cls, f.name))
    out[f.name] = value
  return out


# Field metadata of a dataclass field that is not a config key.
NOT_A_KEY = {"config_key": False}


def _key_fields(cls: type) -> list[dataclasses.Field]:
  return [f for f in dataclasses.fields(cls)
          if f.metadata.get("config_key", True)]


def field_names(cls: type) -> tuple[str, ...]:
  """The config keys of a section's dataclass: its fields, in order."""
  return tuple(f.name for f in _key_fields(cls))


def check_keys(section: str, values: Any, known: set[str], *,
               required: bool = False) -> None:
  """Raises for keys of `values` not in `known` (and missing ones).

  Args:
    section: the section's name, e.g. "model" (for the message).
    values: a ConfigDict or mapping.
    known: the allowed keys.
    required: every known key must be present.

  Raises:
    ValueError: `values` is not a mapping, or has an unknown (or, with
      `required`, lacks a) key; the message names it.
  """
  if not isinstance(values, (ml_collections.ConfigDict, dict)):
    raise ValueError(f"config.{section} must be a ConfigDict, got "
                     f"{type(values).__name__}.")
  keys = set(values.keys())
  unknown = sorted(keys - known)
  if unknown:
    raise ValueError(
        f"Unknown config key 'config.{section}.{unknown[0]}' (unknown: "
        f"{unknown}); known keys of config.{section}: {sorted(known)}.")
  missing = sorted(known - keys) if required else []
  if missing:
    raise ValueError(f"Missing config keys in config.{section}: {missing}.")


def from_config(cls: type[T], values: Any, section: str, *,
                required: bool = False) -> T:
  """Reads a ConfigDict (or mapping, or a `cls`) into a validated `cls`.

  Missing keys and None values take the field's default; a sub-section
  (a field whose type is a dataclass) is read the same way.

  Args:
    cls: the dataclass.
    values: the section.
    section: its name in messages, e.g. "model".
    required: every field must be present (see `check_keys`).

  Returns:
    The `cls` instance.

  Raises:
    ValueError: an unknown key, a missing key without a default, or a value
      that the dataclass rejects.
  """
  if isinstance(values, cls):
    return values
  check_keys(section, values, set(field_names(cls)), required=required)
  kwargs = {}
  for f in _key_fields(cls):
    value = values[f.name] if f.name in values else None
    if value is None and f.default is dataclasses.MISSING and (
        f.default_factory is dataclasses.MISSING):
      raise ValueError(f"{section} config lacks the required key "
                       f"{f.name!r}.")
    sub = _field_type(cls, f.name)
    if value is not None and dataclasses.is_dataclass(sub):
      value = from_config(sub, value, f"{section}.{f.name}")
    if value is not None:
      kwargs[f.name] = value
  return cls(**kwargs)
