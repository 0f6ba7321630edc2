"""mkdocs hook: docs/spans.md's attribute table, generated from ``torchtrace.attributes.SPAN_ATTRIBUTES``.

The page line ``<!-- attributes: span -->`` becomes the table (key, type, meaning); the build fails when the marker is
missing or a name of ``torchtrace.attributes`` has no row (the same table the package's readers and writers use).
"""

from __future__ import annotations

from typing import Any

from torchtrace import attributes

MARKER = "<!-- attributes: span -->"


class AttributeDocsError(Exception):
    """The attribute names and their documentation disagree."""


def check() -> None:
    keys = " ".join(key for key, _, _ in attributes.SPAN_ATTRIBUTES)
    names = {name: value for name, value in vars(attributes).items() if name.isupper() and isinstance(value, str)}
    missing = sorted(name for name, value in names.items() if value not in keys)
    if missing:
        raise AttributeDocsError(f"attributes without a row in SPAN_ATTRIBUTES: {', '.join(missing)}")


def table() -> str:
    rows = ["| key | type | meaning |", "|---|---|---|"]
    rows += [f"| `{key}` | {kind} | {meaning} |" for key, kind, meaning in attributes.SPAN_ATTRIBUTES]
    return "\n".join(rows)


def render(markdown: str) -> str:
    check()
    if MARKER not in markdown:
        raise AttributeDocsError(f"docs/spans.md has no {MARKER} line")
    return markdown.replace(MARKER, table())


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != "spans.md":
        return markdown
    from mkdocs.exceptions import PluginError

    try:
        return render(markdown)
    except AttributeDocsError as error:
        raise PluginError(f"docs/spans.md: {error}") from None
