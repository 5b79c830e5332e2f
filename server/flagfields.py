"""Dataclass fields that carry their command-line flag, and the walk from them to argparse and back to args; stdlib only.

A field's `metadata` (built by `opt`) holds its flag, help text and argparse extras (choices,
metavar, required, action). A field whose default factory is itself such a dataclass is a group:
its fields are walked in place, and their argparse dest is the dotted path (`cache.block_size`).
Fields without a flag are not on the command line. `warmfleet serve` (server/config.py) and
`warmfleet route` (server/router/core/settings.py) declare their flags this way; the operator renders
pod args with `to_args`, so it imports this module and must find nothing heavy here.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Iterator, Optional, Sequence


def opt(flag: str, help: Optional[str], **kw: Any) -> dict:
    """Field metadata: the flag, its help text and argparse extras (choices, metavar, required, action)."""
    return {"flag": flag, "help": help, **kw}


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def _group(f: dataclasses.Field) -> Optional[type]:
    """The dataclass a group field holds, or None for a leaf."""
    factory = f.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


def flag_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """(dotted path, field) of every flag-carrying field of `cls`, groups walked in place, in declaration order."""
    for f in dataclasses.fields(cls):
        sub = _group(f)
        if sub is not None:
            yield from flag_fields(sub, f"{prefix}{f.name}.")
        elif "flag" in f.metadata:
            yield prefix + f.name, f


def flag_of(cls: type, name: str) -> str:
    """The command-line flag of a field (a dotted path into groups); raises KeyError for an unknown field."""
    for path, f in flag_fields(cls):
        if path == name:
            return f.metadata["flag"]
    raise KeyError(f"{cls.__name__} has no flag field {name!r}")


def _field_type(f: dataclasses.Field) -> Any:
    t = str(f.type)
    if "float" in t:
        return float
    if "int" in t:
        return int
    return str


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, show_defaults: bool = False,
                  sections: bool = False, metavar_from_flag: bool = True) -> None:
    """One argparse flag per field of `cls`, named, typed and documented by its metadata.

    show_defaults: append "(default: X)" to each help; sections: one argparse group per group field;
    metavar_from_flag: `--block-size BLOCK_SIZE` rather than argparse's `--block-size CACHE.BLOCK_SIZE`."""
    targets: dict[str, Any] = {}
    for path, f in flag_fields(cls):
        md, default = f.metadata, _default(f)
        section = path.rpartition(".")[0]
        if sections and section and section not in targets:
            targets[section] = parser.add_argument_group(section)
        target = targets.get(section, parser)
        help_ = md["help"] if not show_defaults else f"{md['help']} (default: {default})"
        kw: dict[str, Any] = {"dest": path, "help": help_, "default": default}
        action = md.get("action")
        if action in ("store_true", "store_false"):
            kw["action"] = action
        elif isinstance(default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            if action in ("append", "extend"):  # "extend": `--flag A B` and `--flag A --flag B` alike
                kw["action"] = action
                kw["default"] = None
                if action == "extend":
                    kw["nargs"] = "+"
            else:
                kw["type"] = _field_type(f)
            if "choices" in md:
                kw["choices"] = md["choices"]
            elif "metavar" in md or metavar_from_flag:
                kw["metavar"] = md.get("metavar") or md["flag"].lstrip("-").replace("-", "_").upper()
        if md.get("required"):
            kw["required"] = True
        target.add_argument(md["flag"], **kw)


def from_namespace(ns: argparse.Namespace, cls: type, prefix: str = "") -> Any:
    """Build `cls` (and its groups) from flags parsed by `add_arguments`; its __post_init__ validates."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        sub = _group(f)
        if sub is not None:
            kwargs[f.name] = from_namespace(ns, sub, f"{prefix}{f.name}.")
        elif "flag" in f.metadata:
            v = getattr(ns, prefix + f.name)
            kwargs[f.name] = [] if v is None and f.metadata.get("action") in ("append", "extend") else v
    return cls(**kwargs)


def to_args(obj: Any, fields: Optional[Sequence[str]] = None) -> list[str]:
    """Render `obj` as command-line arguments that `add_arguments` + `from_namespace` read back to it.

    fields=None: every field that differs from its default, in declaration order; else exactly
    these (dotted paths), in this order, default or not."""
    by_path = dict(flag_fields(type(obj)))
    paths = fields if fields is not None else [p for p, f in by_path.items() if _value(obj, p) != _default(f)]
    args: list[str] = []
    for path in paths:
        f, v = by_path[path], _value(obj, path)
        flag, action = f.metadata["flag"], f.metadata.get("action")
        if action in ("store_true", "store_false"):
            args += [flag] if v == (action == "store_true") else []
        elif isinstance(v, bool):
            args.append(flag if v else "--no-" + flag[2:])
        elif isinstance(v, list):
            for item in v:
                args += [flag, str(item)]
        elif v is not None:
            args += [flag, str(v)]
    return args


def _value(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj
