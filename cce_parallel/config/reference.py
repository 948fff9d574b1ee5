"""The recipe keys as a Markdown reference, read from the schema itself: every section's fields,
their types, defaults and docstrings (the string under each field). docs/recipes.md renders it
(``python -m benchmarks render --docs``), so the reference cannot drift from the schema.
"""

import ast
import dataclasses
import inspect
import textwrap


def field_docs(cls) -> dict:
    """{field: its docstring, one line} of a section dataclass, from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _types(cls) -> dict:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {n.target.id: ast.unparse(n.annotation) for n in tree.body[0].body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    return "null" if value is None else repr(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def recipe_reference() -> str:
    """One table per section of the Recipe: key, type, default (the tiny recipe's), meaning."""
    from cce_parallel.config.schema import Recipe

    parts = []
    for section in dataclasses.fields(Recipe):
        cls = section.default_factory().__class__
        docs, types = field_docs(cls), _types(cls)
        summary = " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())
        rows = [f"### `{section.name}`", "", summary, "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            if f.name.startswith("_"):
                continue
            rows.append(f"| `{section.name}.{f.name}` | `{_cell(types.get(f.name, ''))}` | `{_cell(_default(f))}` "
                        f"| {_cell(docs.get(f.name, ''))} |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts)
