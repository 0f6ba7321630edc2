"""The docs site builds strictly, and its configuration tables cover every option (docs/hooks/config_tables.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from checkout import checkout_env
from extras import require_modules

from torchtrace._core import options as _config

ROOT = Path(__file__).resolve().parent.parent


def _config_tables():
    spec = importlib.util.spec_from_file_location("config_tables", ROOT / "docs" / "hooks" / "config_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    """Broken links, a missing page in the nav, a docstring the API page cannot render, an undocumented option:
    each fails `mkdocs build --strict`."""
    require_modules("mkdocs", "material", "mkdocstrings")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    page = (tmp_path / "site" / "configuration" / "index.html").read_text(encoding="utf-8")
    for field in dataclasses.fields(_config.Options):
        assert f"<code>{field.name}</code>" in page  # a generated row per option
    assert "TORCHTRACE_TRITON" in page and "&lt;!-- options" not in page
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    assert "Trace every call of the selected modules" in api  # instrument()'s docstring
    spans = (tmp_path / "site" / "spans" / "index.html").read_text(encoding="utf-8")
    assert "<code>torchtrace.module.path</code>" in spans and "&lt;!-- attributes" not in spans  # the table, generated


def test_every_option_and_variable_is_documented() -> None:
    """A table per group: the plain keywords, each option object's fields, the process-wide settings."""
    tables = _config_tables()
    tables.check()
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    rendered = tables.render(page)
    sections = dict(re.findall(r"^## (\S+).*?\n(.*?)(?=^## |\Z)", rendered, re.M | re.S))
    for group, owner in tables._owners().items():
        section = sections[
            "instrument()" if group == "instrument" else group if group != "configure" else "Process-wide"
        ]
        for field in dataclasses.fields(owner):
            assert f"| `{field.name}` |" in section, (group, field.name)
    assert "| `triton` | `TORCHTRACE_TRITON` |" in sections["Process-wide"]


def test_an_option_declared_without_its_documentation_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    tables = _config_tables()
    careless = dataclasses.make_dataclass(
        "Stats", [("brand_new", int, dataclasses.field(default=None))], bases=(_config.Stats,), frozen=True
    )
    monkeypatch.setitem(_config.GROUPS, "stats", careless)
    with pytest.raises(tables.ConfigDocsError, match="Stats.brand_new is not declared with option"):
        tables.check()


def test_a_variable_the_package_reads_and_no_page_documents_fails(monkeypatch, tmp_path) -> None:
    tables = _config_tables()
    (tmp_path / "new_part.py").write_text('NEW = os.environ.get("TORCHTRACE_NEW_THING")\n')
    monkeypatch.setattr(tables, "PACKAGE", tmp_path)
    monkeypatch.setitem(tables.DOCUMENTED_ELSEWHERE, "TORCHTRACE_ELSEWHERE", "ddp.md")
    with pytest.raises(tables.ConfigDocsError) as error:
        tables.check()
    assert "TORCHTRACE_NEW_THING is read by torchtrace and documented nowhere" in str(error.value)
    assert "TORCHTRACE_ELSEWHERE is not on ddp.md" in str(error.value)


def test_a_group_without_its_table_on_the_page_fails() -> None:
    tables = _config_tables()
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8").replace("<!-- options: Training -->", "")
    with pytest.raises(tables.ConfigDocsError, match="Training"):
        tables.render(page)


def test_the_api_page_covers_every_public_name() -> None:
    import torchtrace

    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    documented = {line.removeprefix("::: torchtrace.") for line in page.splitlines() if line.startswith(":::")}
    assert set(torchtrace.__all__) - {"__version__"} <= documented


def test_the_readme_stays_one_page_and_its_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    targets = re.findall(r"\]\(((?:docs/|CHANGELOG)[^)#]*)", readme)
    assert targets and all((ROOT / target).exists() for target in targets), targets
    assert "scripts/dev demo" in readme and "scripts/dev test" in readme


def _recipes() -> dict[str, str]:
    page = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    return dict(re.findall(r"<!-- recipe: (\w+) -->\n```python\n(.*?)```", page, flags=re.S))


@pytest.mark.parametrize(
    ("name", "library", "model"),
    [("trainer", "transformers", "GPT2LMHeadModel"), ("accelerate", "accelerate", "Sequential"),
     ("lightning", "lightning", "net")],
)  # fmt: skip
def test_each_training_recipe_runs_as_written_and_traces_every_step(
    name: str, library: str, model: str, tmp_path: Path
) -> None:
    """docs/training.md's recipes, run as they are on the page (in a fresh process): one ``train_step`` trace per
    optimizer step, each with the model's forward and backward under it."""
    require_modules(library)
    report = "import json\nprint(json.dumps({row.path: row.calls for row in handle.summary_rows()}))\n"
    env = checkout_env(TORCHTRACE_EXPORTER="none")  # the recipe's default exporter would write a trace file
    result = subprocess.run(
        [sys.executable, "-c", _recipes()[name] + report], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    calls = json.loads(result.stdout.strip().splitlines()[-1])
    assert calls["train_step"] == 4
    assert calls[model] == 4 and calls[f"{model} backward"] == 4


def test_no_attribute_name_is_spelled_outside_torchtrace_attributes() -> None:
    """Every writer and reader of span attributes takes the names from ``torchtrace.attributes``: no string in the
    package (docstrings aside) is one of its names, or a statistic's key under one of its prefixes."""
    import ast

    from torchtrace import attributes

    names = {value for name, value in vars(attributes).items() if name.isupper() and isinstance(value, str)}
    spelled = []
    for path in sorted((ROOT / "torchtrace").rglob("*.py")):
        if path.name == "attributes.py" or "_vendor" in path.parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        strings = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
        ]
        spelled += [
            f"{path.name}:{node.lineno}: {node.value}"
            for node in strings
            if any(node.value == name or node.value.startswith(name + ".") for name in names)
        ]
    assert not spelled


def _hook(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_span_attribute_table_is_generated_from_torchtrace_attributes() -> None:
    """docs/spans.md's table: a row per entry of ``SPAN_ATTRIBUTES``, and every name of the module in one."""
    from torchtrace import attributes

    table = _hook("attribute_table")
    rendered = table.render((ROOT / "docs" / "spans.md").read_text(encoding="utf-8"))
    for key, kind, _ in attributes.SPAN_ATTRIBUTES:
        assert f"| `{key}` | {kind} |" in rendered
    names = [value for name, value in vars(attributes).items() if name.isupper() and isinstance(value, str)]
    assert names and all(f"`{name}" in rendered for name in names)


def test_an_attribute_name_without_a_row_fails_the_docs(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtrace import attributes

    table = _hook("attribute_table")
    monkeypatch.setattr(attributes, "BRAND_NEW", "torchtrace.brand_new", raising=False)
    with pytest.raises(table.AttributeDocsError, match="BRAND_NEW"):
        table.render((ROOT / "docs" / "spans.md").read_text(encoding="utf-8"))


# What the docs' snippets take as given (a model, a batch, an optimizer...): defined before each runs, per page where
# a page needs more (a process group, spikingjelly's monitors).
SNIPPET_GIVENS = """
import torch
from torch import nn
import torchtrace

class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 4)
        self.head = nn.Sigmoid()

    def forward(self, x):
        return self.head(self.encoder(x))

model = MyModel()
batch = x = torch.randn(3, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = [torch.randn(3, 4) for _ in range(12)]

def loss_fn(output):
    return output.sum()
"""
PAGE_GIVENS = {
    "ddp.md": """
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
""",
    "large-jobs.md": """
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
""",
    "drift.md": """
loader = [torch.randn(3, 4) for _ in range(100)]
_made = torchtrace.instrument(model, exporter="none", records=torchtrace.Records(max_records=50_000))
for _batch in loader:
    model(_batch)
_made.baseline().save("baseline.json")  # a baseline of the model, as the page's first snippet makes one
_made.remove()
""",
    "records.md": """
from spikingjelly.activation_based import layer, monitor, neuron
net = nn.Sequential(layer.Linear(4, 4), neuron.IFNode(), layer.Linear(4, 2), neuron.IFNode())
x = torch.rand(3, 4) * 3
""",
}
# After it: its test functions called, a handle it left open used once (a forward, a step) and removed.
SNIPPET_AFTER = """
for name, value in list(globals().items()):
    if name.startswith("test_") and callable(value):
        value()
handle = globals().get("handle")
if handle is not None:
    traced = globals().get("ddp", model)
    traced(x).sum().backward()
    handle.step() if handle.options.optimizer is None and handle.options.backward else optimizer.step()
    handle.remove()
print("ran")
"""


def _snippets() -> list[tuple[str, str]]:
    """(page and number, code) of every Python snippet in the README and docs/, but the training recipes (run by
    their own test)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        page = path.read_text(encoding="utf-8")
        blocks = re.findall(r"(<!-- recipe: \w+ -->\n)?```python\n(.*?)```", page, flags=re.S)
        found += [(f"{path.name}#{number}", code) for number, (recipe, code) in enumerate(blocks, 1) if not recipe]
    return found


@pytest.mark.parametrize(("where", "code"), _snippets(), ids=[where for where, _ in _snippets()])
def test_every_docs_snippet_runs_as_written(where: str, code: str, tmp_path: Path) -> None:
    """Each snippet, as it is on its page, in a fresh process, after the givens it takes for granted."""
    page = where.partition("#")[0]
    if page == "records.md":
        require_modules("spikingjelly")
    givens = SNIPPET_GIVENS + PAGE_GIVENS.get(page, "").replace("{port}", str(_free_port()))
    env = checkout_env(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OTEL_EXPORTER_OTLP_TIMEOUT="1")
    result = subprocess.run(
        [sys.executable, "-c", givens + code + SNIPPET_AFTER], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0 and result.stdout.rstrip().endswith("ran"), result.stderr[-3000:]


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
