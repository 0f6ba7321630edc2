"""mkdocs hook: the configuration tables, generated from torchtrace/_core/options.py and settings.py at build time.

A page line ``<!-- options: GROUP -->`` becomes the table of that group: ``instrument`` (the plain keywords), an
option object's class name (``Stats``, ``TraceFile``, ...) or ``configure`` (the process-wide settings). Each row
(option, environment variable, default, meaning) comes from the option's own declaration (``option()``). The build
fails when a group's table is not on the page, a field of an option object is not declared with ``option()``, or
the package reads a ``TORCHTRACE_*`` variable that no table and no page in ``DOCUMENTED_ELSEWHERE`` documents.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import Any

from torchtrace._core import options as _config
from torchtrace._core import settings as _settings

MARKER = re.compile(r"^<!-- options: (?P<group>[^>]+?) -->$", re.M)
PACKAGE = Path(_config.__file__).resolve().parent.parent
DOCS = Path(__file__).resolve().parent.parent
VARIABLE = re.compile(r"TORCHTRACE_[A-Z_]+[A-Z]")
# Variables read outside the options, each documented on its own page.
DOCUMENTED_ELSEWHERE = {
    "TORCHTRACE_METRICS_PORT": "metrics.md",
    "TORCHTRACE_METRICS_ADDR": "metrics.md",
    "TORCHTRACE_RUN_ID": "ddp.md",
}


class ConfigDocsError(Exception):
    """The options and their documentation disagree."""


def _owners() -> dict[str, Any]:
    """Group name -> the dataclass whose fields it tables."""
    return {
        "instrument": _config.Options,
        **{kind.__name__: kind for kind in _config.GROUPS.values()},
        "configure": _settings.Settings,
    }


def groups() -> list[str]:
    return list(_owners())


def _declared(owner: Any) -> list[Any]:
    """The fields of ``owner`` declared with ``option()``: the grouped keywords of ``Options`` have their tables."""
    return [item for item in fields(owner) if not (owner is _config.Options and item.name in _config.GROUPS)]


def _default(item: Any) -> str:
    meta = item.metadata
    if meta.get("shown"):
        return meta["shown"]
    value = meta["default"]
    if value is None:
        return "`None`"
    if isinstance(value, tuple):
        return f"`{','.join(map(str, value))}`" if value else "none"
    if isinstance(value, dict) or type(value).__name__ == "mappingproxy":
        return "none" if not value else f"`{dict(value)}`"
    return f"`{value}`"


def check() -> None:
    """Raises ConfigDocsError naming every option without a declaration and every variable documented nowhere."""
    problems = []
    documented = set()
    for group, owner in _owners().items():
        for item in _declared(owner):
            if "doc" not in item.metadata:
                problems.append(f"{group}.{item.name} is not declared with option() (no documentation)")
            elif item.metadata["env"]:
                documented.add(item.metadata["env"])
    for variable, page in DOCUMENTED_ELSEWHERE.items():
        if variable not in (DOCS / page).read_text(encoding="utf-8"):
            problems.append(f"{variable} is not on {page}")
    read = {match for path in PACKAGE.rglob("*.py") for match in VARIABLE.findall(path.read_text(encoding="utf-8"))}
    problems += [f"{name} is read by torchtrace and documented nowhere" for name in
                 sorted(read - documented - set(DOCUMENTED_ELSEWHERE))]  # fmt: skip
    if problems:
        raise ConfigDocsError("; ".join(problems))


def options_table(group: str) -> str:
    owner = _owners().get(group)
    if owner is None:
        raise ConfigDocsError(f"no option group {group!r}")
    rows = ["| option | env | default | |", "|---|---|---|---|"]
    for item in fields(owner):
        if owner is _config.Options and item.name in _config.GROUPS:
            kind = _config.GROUPS[item.name].__name__
            plain = _config.PLAIN_VALUES.get(item.name)
            plain = f", or {plain}" if plain else ""
            rows.append(f"| `{item.name}` | | | a [`{kind}`](#{kind.lower()}) (below){plain} |")
            continue
        meta = item.metadata
        env = f"`{meta['env']}`" if meta["env"] else ""
        rows.append(f"| `{item.name}` | {env} | {_default(item)} | {meta['doc']} |")
    return "\n".join(rows)


def render(markdown: str) -> str:
    """``markdown`` with every marker replaced by its table; every group must have its marker."""
    check()
    missing = set(groups()) - {match["group"] for match in MARKER.finditer(markdown)}
    if missing:
        raise ConfigDocsError(f"groups without a table on the page: {sorted(missing)}")
    return MARKER.sub(lambda match: options_table(match["group"]), markdown)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != "configuration.md":
        return markdown
    from mkdocs.exceptions import PluginError

    try:
        return render(markdown)
    except ConfigDocsError as error:
        raise PluginError(f"docs/configuration.md: {error}") from None
