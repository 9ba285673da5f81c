"""The flags of `islands run`, made from RunConfig's fields: one flag per setting, spelled as its
TOML key (`inner_steps` → `--inner-steps`, `[quorum] min_quorum` → `--quorum.min-quorum`), with
the field's help text and default, so a new setting is one line in islands.core.config.

The flags only collect text; RunConfig validates it, so a bad value gets the same one-line error
(naming the field) from a flag, a TOML file or the UI form.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Literal

from pydantic import BaseModel

from islands.core.config import RunConfig


def _flag(path: str) -> str:
    return "--" + path.replace("_", "-")


def _is_section(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _bare(annotation):
    """The annotation without its `| None`."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(kinds) == 1:
            return kinds[0]
    return annotation


METAVARS = {int: "N", float: "NUMBER", str: "TEXT"}


def _pair(kind):
    """Parses KEY=VALUE, the value as `kind`."""

    def parse(value: str) -> tuple[str, object]:
        key, sep, item = value.partition("=")
        try:
            if not sep or not key.strip():
                raise ValueError
            return key.strip(), kind(item.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes KEY={METAVARS[kind]}, e.g. eu-west=0.33 (got {value!r})") from None

    parse.__name__ = f"KEY={METAVARS[kind]}"
    return parse


def fields(model: type[BaseModel] = RunConfig, prefix: str = ""):
    """(dotted path, field) of every setting of `model`, its sections' fields included."""
    for name, field in model.model_fields.items():
        if _is_section(field.annotation):
            yield from fields(field.annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def add_run_flags(parser: argparse.ArgumentParser, model: type[BaseModel] = RunConfig) -> None:
    """One flag per field of `model` (RunConfig), its dotted path as the dest."""
    group = parser.add_argument_group("settings (each a field of the config file; defaults as there)")
    for path, field in fields(model):
        kind = _bare(field.annotation)
        origin = typing.get_origin(kind)
        default = "" if field.default is None else f" (default: {field.default})"
        help_ = (field.description or "").replace("%", "%%") + default.replace("%", "%%")
        common = {"dest": path, "default": None, "help": help_}
        if kind is bool:
            group.add_argument(_flag(path), action=argparse.BooleanOptionalAction, **common)
        elif origin is Literal:
            choices = typing.get_args(kind)  # strings, or numbers (topk.value_bits) read as such
            group.add_argument(_flag(path), choices=choices, type=type(choices[0]), **common)
        elif origin is list:
            group.add_argument(_flag(path), metavar="A,B,…", **common)
        elif origin is dict:
            value_kind = typing.get_args(kind)[1]
            group.add_argument(
                _flag(path), type=_pair(value_kind), action="append", metavar=f"KEY={METAVARS[value_kind]}", **common
            )
        else:
            group.add_argument(_flag(path), type=kind, metavar=METAVARS[kind], **common)


def overrides(args: argparse.Namespace, model: type[BaseModel] = RunConfig) -> dict:
    """{dotted path: value} of the flags given, for load_config (which validates them)."""
    out: dict = {}
    for path, field in fields(model):
        value = getattr(args, path, None)
        if value is None:
            continue
        origin = typing.get_origin(_bare(field.annotation))
        if origin is list:
            value = [item.strip() for item in value.split(",") if item.strip()]
        elif origin is dict:
            value = dict(value)
        out[path] = value
    return out
