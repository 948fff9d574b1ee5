"""Strict YAML loading of recipes: unknown keys and wrong types are errors that name the key.

    recipe = load_recipe("recipes/gpt2-small-owt.yaml", ["train.steps=100", "data.source=stdlib"])
    text = dump_recipe(recipe)          # the resolved recipe, every field, as YAML

Overrides (``--set section.key=value``) are parsed as YAML scalars (``null``, ``true``, ``3e-4``)
and applied to the file's mapping before the dataclasses are built, so they meet the same checks. Types follow the annotations: an int is accepted where a float is expected, nothing
else is converted (``"3"`` is not an int, ``1`` is not a bool).
"""

import dataclasses
import re
import types
import typing
from pathlib import Path

import yaml

from cce_parallel.config.schema import SECTIONS, Recipe
from cce_parallel.config.section import RecipeError


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``3e-4`` as a float (YAML 1.2) rather than the string YAML 1.1 makes of it."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)


def load_recipe(path=None, overrides=()) -> Recipe:
    """Build a Recipe from a YAML file (None: the defaults, i.e. the tiny recipe) and overrides."""
    raw = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise RecipeError(f"recipe file {str(path)!r} does not exist")
        try:
            raw = _yaml_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise RecipeError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise RecipeError(f"{path}: a recipe is a mapping of sections, got {type(raw).__name__}")
    for item in overrides:
        apply_override(raw, item)
    return recipe_from_dict(raw)


def apply_override(raw: dict, item: str) -> None:
    """Apply one ``section.key=value`` override to a raw recipe mapping, in place."""
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise RecipeError(f"override {item!r}: expected section.key=value, e.g. train.steps=100")
    section, name = parts
    try:
        value = _yaml_load(text) if text.strip() else None
    except yaml.YAMLError as err:
        raise RecipeError(f"override {item!r}: the value is not valid YAML: {err}") from None
    target = raw.setdefault(section, {})
    if not isinstance(target, dict):
        raise RecipeError(f"{section}: must be a mapping, got {type(target).__name__}")
    target[name] = value


def recipe_from_dict(raw: dict) -> Recipe:
    """Build and check a Recipe from a plain mapping (strict: unknown keys and wrong types raise)."""
    if not isinstance(raw, dict):
        raise RecipeError(f"a recipe is a mapping of sections, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise RecipeError(f"{unknown[0]}: unknown section; known sections: {', '.join(SECTIONS)}")
    sections = {}
    for name, cls in SECTIONS.items():
        values = raw.get(name) or {}
        if not isinstance(values, dict):
            raise RecipeError(f"{name}: must be a mapping of keys, got {type(values).__name__}")
        sections[name] = _build_section(name, cls, values)
    return Recipe(**sections)


def _build_section(section: str, cls, values: dict):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in values:
        if key not in fields:
            close = [k for k in fields if k.startswith(str(key)[:3])]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise RecipeError(f"{section}.{key}: unknown key{hint}; known keys: {', '.join(fields)}")
    kwargs = {key: _check_type(f"{section}.{key}", value, hints[key]) for key, value in values.items()}
    return cls(**kwargs)


def _check_type(key: str, value, annotation):
    """Return value (an int promoted to float where a float is expected) or raise naming key."""
    ok, converted = _match(value, annotation)
    if not ok:
        raise RecipeError(f"{key}: expected {_describe(annotation)}, got {value!r} ({type(value).__name__})")
    return converted


def _match(value, annotation):
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            ok, converted = _match(value, option)
            if ok:
                return True, converted
        return False, None
    if origin is typing.Literal:
        return value in typing.get_args(annotation) and not isinstance(value, bool), value
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if not isinstance(value, list):
            return False, None
        matched = [_match(v, item_type) for v in value]
        return all(ok for ok, _ in matched), [v for _, v in matched]
    if origin is dict:
        key_type, value_type = typing.get_args(annotation)
        if not isinstance(value, dict):
            return False, None
        out = {}
        for k, v in value.items():
            ok_k, k2 = _match(k, key_type)
            ok_v, v2 = _match(v, value_type)
            if not (ok_k and ok_v):
                return False, None
            out[k2] = v2
        return True, out
    if annotation is type(None):
        return value is None, None
    if annotation is bool:
        return isinstance(value, bool), value
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else None
    if annotation is str:
        return isinstance(value, str), value
    raise TypeError(f"unsupported annotation {annotation!r} in the recipe schema")


def _describe(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin is list:
        return f"a list of {_describe(typing.get_args(annotation)[0])}"
    if origin is dict:
        k, v = typing.get_args(annotation)
        return f"a mapping of {_describe(k)} to {_describe(v)}"
    if annotation is type(None):
        return "null"
    return {bool: "a bool (true/false)", int: "an int", float: "a number", str: "a string"}.get(
        annotation, str(annotation)
    )


def recipe_to_dict(recipe: Recipe) -> dict:
    """Every field of the recipe as plain YAML-able values, sections in schema order."""
    return dataclasses.asdict(recipe)


def dump_recipe(recipe: Recipe, header: str = "") -> str:
    """The resolved recipe as YAML (loading it back gives an equal Recipe)."""
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, default_flow_style=False)


def diff_from_defaults(recipe: Recipe) -> dict:
    """The fields that differ from the defaults, as {section: {key: value}}."""
    ours, base = recipe_to_dict(recipe), recipe_to_dict(Recipe())
    out = {}
    for section, values in ours.items():
        changed = {k: v for k, v in values.items() if base[section][k] != v}
        if changed:
            out[section] = changed
    return out
