"""Dataclass ↔ OpenAPI v3 schema and dict conversion: the machinery that makes spec types the single source; no kopf."""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from dataclasses import MISSING
from typing import Any, Callable, Literal, Union

# A CEL rule kept next to its Python twin: the API server evaluates `rule`, `check` runs
# offline (render, kmock) where no CEL evaluator exists. `check` takes the parsed object.
Rule = tuple[str, str, Callable[[Any], bool]]


class SpecError(ValueError):
    """One readable problem with a spec: `path` is the JSON path (e.g. `spec.cache.swapSpace`)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def prop(default: Any = MISSING, *, doc: str, **schema: Any) -> Any:
    """A spec field: `doc` becomes the CRD description; extra keys are OpenAPI keywords (minimum, enum, ...)."""
    md = {"doc": doc, "schema": schema}
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: copy.deepcopy(value), metadata=md)
    if dataclasses.is_dataclass(default):
        cls = type(default)
        return dataclasses.field(default_factory=cls, metadata=md)
    return dataclasses.field(default=default, metadata=md)


def camel(name: str) -> str:
    """snake_case → camelCase, the Kubernetes field spelling."""
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not MISSING or f.default_factory is not MISSING  # type: ignore[misc]


def _default_value(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def schema_of(tp: Any) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a type annotation (dataclass, Literal, list, dict, scalar)."""
    tp, _ = _unwrap_optional(tp)
    origin = typing.get_origin(tp)
    if hasattr(tp, "__openapi_schema__"):  # a type that carries its own schema and parser (spec/pod_overlay.py)
        return copy.deepcopy(tp.__openapi_schema__)
    if dataclasses.is_dataclass(tp):
        return _object_schema(tp)
    if origin is Literal:
        values = list(typing.get_args(tp))
        return {**schema_of(type(values[0])), "enum": values}
    if origin is list:
        (item,) = typing.get_args(tp)
        return {"type": "array", "items": schema_of(item)}
    if origin is dict:
        _, value = typing.get_args(tp)
        return {"type": "object", "additionalProperties": schema_of(value)}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    raise TypeError(f"no schema for {tp!r}")


def _object_schema(cls: type) -> dict[str, Any]:
    hints = _hints(cls)
    props: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        tp, optional = _unwrap_optional(hints[f.name])
        s = schema_of(tp)
        s["description"] = f.metadata["doc"]
        s.update(f.metadata.get("schema", {}))
        if _has_default(f):
            d = to_dict(_default_value(f))
            if d is not None and d != [] and (dataclasses.is_dataclass(tp) or not optional):
                s["default"] = d
        elif not optional:
            required.append(camel(f.name))
        props[camel(f.name)] = s
    out: dict[str, Any] = {"type": "object", "properties": props}
    if cls.__doc__:
        out["description"] = cls.__doc__.strip().splitlines()[0]
    if required:
        out["required"] = required
    rules = getattr(cls, "RULES", ())
    if rules:
        out["x-kubernetes-validations"] = [{"rule": r, "message": m} for r, m, _ in rules]
    return out


def to_dict(value: Any) -> Any:
    """A dataclass tree → the camelCase dict Kubernetes stores; None fields are omitted."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in dataclasses.fields(value):
            v = to_dict(getattr(value, f.name))
            if v is not None:
                out[camel(f.name)] = v
        return out
    if isinstance(value, list):
        return [to_dict(v) for v in value]
    if isinstance(value, dict):
        return {k: to_dict(v) for k, v in value.items()}
    return value


def from_dict(cls: type, data: Any, path: str = "spec") -> Any:
    """Parse a camelCase dict into `cls`, applying the CRD defaults and checking types, ranges and rules.

    Unknown keys are errors (a real API server would prune them silently; offline render
    should catch the typo instead).
    """
    if not isinstance(data, dict):
        raise SpecError(path, f"must be an object, got {type(data).__name__}")
    hints = _hints(cls)
    fields = {camel(f.name): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise SpecError(path, f"unknown field(s) {', '.join(unknown)}")
    kwargs = {}
    for key, f in fields.items():
        sub = f"{path}.{key}"
        tp, optional = _unwrap_optional(hints[f.name])
        if key not in data or data[key] is None:
            if _has_default(f):
                kwargs[f.name] = _default_value(f)
            elif optional:
                kwargs[f.name] = None
            else:
                raise SpecError(sub, "is required")
            continue
        value = _parse_value(tp, data[key], sub)
        _check_keywords(f.metadata.get("schema", {}), value, sub)
        kwargs[f.name] = value
    obj = cls(**kwargs)
    for _, message, check in getattr(cls, "RULES", ()):
        if not check(obj):
            raise SpecError(path, message)
    return obj


def _parse_value(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if hasattr(tp, "__parse_spec__"):
        return tp.__parse_spec__(value, path)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise SpecError(path, f"must be one of {', '.join(map(str, allowed))}, got {value!r}")
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise SpecError(path, "must be a list")
        return [_parse_value(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, vt = typing.get_args(tp)
        if not isinstance(value, dict):
            raise SpecError(path, "must be an object")
        return {str(k): _parse_value(vt, v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(path, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(path, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(path, f"must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(path, f"must be a string, got {value!r}")
        return value
    raise TypeError(f"cannot parse {tp!r}")


def _check_keywords(schema: dict[str, Any], value: Any, path: str) -> None:
    if "minimum" in schema and value < schema["minimum"]:
        raise SpecError(path, f"must be >= {schema['minimum']}, got {value}")
    if "maximum" in schema and value > schema["maximum"]:
        raise SpecError(path, f"must be <= {schema['maximum']}, got {value}")
    if "enum" in schema and value not in schema["enum"]:
        raise SpecError(path, f"must be one of {schema['enum']}, got {value!r}")
    if "minLength" in schema and len(value) < schema["minLength"]:
        raise SpecError(path, f"must be at least {schema['minLength']} characters")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        raise SpecError(path, f"must be at most {schema['maxLength']} characters")
    if "pattern" in schema and not re.fullmatch(schema["pattern"], value):
        raise SpecError(path, f"must match {schema['pattern']}, got {value!r}")
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        raise SpecError(path, f"must have at most {schema['maxItems']} items")
