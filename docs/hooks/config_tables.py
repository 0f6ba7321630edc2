"""mkdocs hook: the configuration tables, generated from torchtrace/_core/options.py at build time.

A page line ``<!-- options: GROUP -->`` becomes the table of that group's options (keyword, environment variable,
default, meaning) and ``<!-- env-only -->`` the table of variables read outside ``instrument()``'s options. Names
and defaults come from the ``Options`` dataclass, variables from ``torchtrace config``'s own mapping, the meaning
from ``OPTION_DOCS``. The build fails when an option has no row, a row names no option, an ``ENV_*`` variable is
documented nowhere, or a group is not on the page.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, fields
from typing import Any

from torchtrace import _run
from torchtrace._core import options as _config

MARKER = re.compile(r"^<!-- (options: (?P<group>[^>]+?)|env-only) -->$", re.M)


class ConfigDocsError(Exception):
    """The options and their documentation disagree."""


def _default(field: Any) -> str:
    if field.default is not MISSING:
        value = field.default
    elif field.default_factory is not MISSING:
        value = field.default_factory()
    else:
        return ""
    if isinstance(value, tuple):
        return f"`{','.join(value)}`" if value else "none"
    if isinstance(value, dict):
        return "none" if not value else f"`{value}`"
    return f"`{value}`"


def check() -> None:
    """Raises ConfigDocsError naming every option or variable without documentation (or documentation of none)."""
    names = [field.name for field in fields(_config.Options)]
    problems = [f"option {name!r} has no row in OPTION_DOCS" for name in names if name not in _config.OPTION_DOCS]
    problems += [f"OPTION_DOCS row {name!r} names no option" for name in _config.OPTION_DOCS if name not in names]
    option_env = {env for name in names for env in _run._env_names(name)}
    for attribute, value in sorted(vars(_config).items()):
        if not (attribute.startswith("ENV_") and isinstance(value, str)):
            continue
        if value not in option_env and value not in _config.ENV_ONLY_DOCS:
            problems.append(f"{attribute} ({value}) is read by no documented option and not in ENV_ONLY_DOCS")
    if problems:
        raise ConfigDocsError("; ".join(problems))


def groups() -> list[str]:
    return list(dict.fromkeys(group for group, _ in _config.OPTION_DOCS.values()))


def options_table(group: str) -> str:
    rows = ["| keyword | env | default | |", "|---|---|---|---|"]
    for field in fields(_config.Options):
        row_group, meaning = _config.OPTION_DOCS[field.name]
        if row_group == group:
            env = ", ".join(f"`{name}`" for name in _run._env_names(field.name))
            rows.append(f"| `{field.name}` | {env} | {_default(field)} | {meaning} |")
    if len(rows) == 2:
        raise ConfigDocsError(f"no option in group {group!r}")
    return "\n".join(rows)


def env_only_table() -> str:
    rows = ["| env | |", "|---|---|"]
    rows += [f"| `{name}` | {meaning} |" for name, meaning in _config.ENV_ONLY_DOCS.items()]
    return "\n".join(rows)


def render(markdown: str) -> str:
    """``markdown`` with every marker replaced by its table; every group must have its marker."""
    check()
    missing = set(groups()) - {match["group"] for match in MARKER.finditer(markdown) if match["group"]}
    if missing:
        raise ConfigDocsError(f"groups without a table on the page: {sorted(missing)}")
    return MARKER.sub(lambda match: options_table(match["group"]) if match["group"] else env_only_table(), markdown)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != "configuration.md":
        return markdown
    from mkdocs.exceptions import PluginError

    try:
        return render(markdown)
    except ConfigDocsError as error:
        raise PluginError(f"docs/configuration.md: {error}") from None
