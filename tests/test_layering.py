"""Layering as a test: every module's imports (read with ast) must follow the layer table below, which
must equal the layer picture in the README. Data flows one way — web → server → engine → scheduler →
cache → core, the engine also → model → kernels — and nothing imports upward.

Imports under `if TYPE_CHECKING:` are exempt: they are annotations only (core names the radix tree's
node type that way) and create no dependency at run time.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("radixserve",)

# module (or package prefix) -> layer; the longest matching prefix wins
LAYER_OF = {
    "radixserve.core": "core",
    "radixserve.config": "core",
    "radixserve.errors": "core",
    "radixserve.sampling_params": "core",
    "radixserve.structured": "core",
    "radixserve.schema_objects": "core",
    "radixserve.paths": "core",
    "radixserve.kernels": "kernels",
    "radixserve.cache": "cache",
    "radixserve.model": "model",
    "radixserve.scheduler": "scheduler",
    "radixserve.engine": "engine",
    "radixserve.chat": "chat",
    "radixserve.server": "server",
    "radixserve.bench": "bench",
    "radixserve.scaleout": "scaleout",
    "radixserve": "entry",  # the package's public names, cli.py, terminal_chat.py
}
ALL_LAYERS = ("entry", "scaleout", "server", "bench", "engine", "chat", "scheduler", "model", "cache", "core", "kernels")
# layer -> the other layers it may import (its own is always allowed)
MAY_IMPORT = {
    "entry": {"scaleout", "server", "bench", "engine", "chat", "scheduler", "model", "cache", "core", "kernels"},
    "scaleout": {"server", "engine", "chat", "cache", "core"},
    "server": {"engine", "chat", "core"},
    "bench": {"scaleout", "engine", "chat", "scheduler", "cache", "model", "core", "kernels"},
    "engine": {"chat", "scheduler", "cache", "model", "core"},
    "chat": {"core"},
    "scheduler": {"cache", "core"},
    "model": {"core", "kernels"},
    "cache": {"core"},
    "core": set(),
    "kernels": {"core"},
}


def layer_of(module: str) -> str | None:
    for prefix in sorted(LAYER_OF, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYER_OF[prefix]
    return None  # not ours (stdlib, torch, starlette, ...)


def runtime_imports(source: str, module: str, is_package: bool) -> list[str]:
    """Modules `source` imports outside `if TYPE_CHECKING:` blocks, relative imports resolved."""
    tree = ast.parse(source)
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.append(base)
            found += [f"{base}.{alias.name}" for alias in node.names]  # `from pkg import submodule`
    return found


def violations(modules: dict[str, tuple[str, bool]]) -> list[str]:
    """'a -> b (layer x may not import layer y)' for every upward or sideways edge."""
    bad = []
    for module, (source, is_package) in sorted(modules.items()):
        mine = layer_of(module)
        assert mine is not None, f"{module} is in no layer: add it to LAYER_OF"
        for target in runtime_imports(source, module, is_package):
            theirs = layer_of(target)
            if theirs is not None and theirs != mine and theirs not in MAY_IMPORT[mine]:
                bad.append(f"{module} -> {target} ({mine} may not import {theirs})")
    return sorted(set(bad))


def project_modules() -> dict[str, tuple[str, bool]]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            modules[name] = (path.read_text(), is_package)
    return modules


def test_no_module_imports_upward() -> None:
    modules = project_modules()
    assert len(modules) > 40
    assert violations(modules) == []


@pytest.mark.parametrize(("module", "source"), [
    ("radixserve.cache.synthetic", "from radixserve.scheduler import Scheduler\n"),
    ("radixserve.model.synthetic", "import radixserve.engine.engine\n"),
    ("radixserve.engine.synthetic", "from radixserve.server import app\n"),
    ("radixserve.core", "from radixserve.cache.radix_tree import RadixNode\n"),  # at run time, not type-only
    ("radixserve.scheduler.synthetic", "def f():\n    from ..engine import LLMEngine\n"),  # relative, nested
])
def test_an_upward_import_is_caught(module: str, source: str) -> None:
    modules = {**project_modules(), module: (source, False)}  # a synthetic module, or one rewritten
    assert any(v.startswith(module + " ->") for v in violations(modules)), violations(modules)


def test_type_checking_imports_are_exempt() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from radixserve.engine import LLMEngine\n"
    assert violations({"radixserve.cache.synthetic": (source, False)}) == []


def test_readme_layer_picture_matches_the_table() -> None:
    """The README's table (between the `layers` markers) lists each layer and what it may import."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- layers -->\s*```text\n(.*?)```\s*<!-- /layers -->", readme, re.S)
    assert block is not None, "README.md has no layer table between <!-- layers --> markers"
    pictured: dict[str, set[str]] = {}
    for line in block.group(1).splitlines()[1:]:  # the first line is the header
        layer, _, rest = line.partition(" ")
        deps = rest.split("(")[0].replace(",", " ").split()
        pictured[layer] = set() if deps == ["nothing"] else set(deps)
    assert list(pictured) == list(ALL_LAYERS)
    assert pictured == MAY_IMPORT


def test_architecture_doc_layer_table_matches_the_table() -> None:
    """docs/architecture.md's layer table: one row per layer, its "may import" column exactly MAY_IMPORT."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\w+) \| ([\w, ]+) \| .*\|$", doc.split("<!-- layer table")[1].split("\n\n")[0], re.M)
    documented = {layer: set() if deps.strip() == "nothing" else {d.strip() for d in deps.split(",")} for layer, deps in rows
                  if layer != "layer"}
    assert list(documented) == [layer for layer in ALL_LAYERS if layer in documented] and set(documented) == set(ALL_LAYERS)
    assert documented == MAY_IMPORT


def test_public_names_in_the_docs_still_import() -> None:
    """Every `from radixserve... import ...` in the README and docs resolves, and the package's own
    public names are all there."""
    import importlib

    import radixserve

    texts = [(ROOT / "README.md").read_text(), *(p.read_text() for p in (ROOT / "docs").glob("*.md"))]
    lines = {m.group(0) for t in texts for m in re.finditer(r"^from (radixserve[\w.]*) import ([\w, ]+)$", t, re.M)}
    assert lines, "the docs show no imports"
    for line in sorted(lines):
        module, names = re.match(r"from (\S+) import (.+)", line).groups()  # type: ignore[union-attr]
        mod = importlib.import_module(module)
        for name in (n.strip() for n in names.split(",")):
            assert hasattr(mod, name), f"{line}: {name} is gone"
    for name in ("LLM", "LLMEngine", "AsyncEngine", "EngineConfig", "SamplingParams", "RequestOutput",
                 "CompletionOutput", "Usage", "Timing"):
        assert name in radixserve.__all__ and hasattr(radixserve, name)


# -- one writer of a sequence ------------------------------------------------------------------------
# The scheduler is the only writer of a `Sequence` (its fields and its token list); core.py defines it.
SEQUENCE_WRITERS = ("radixserve.scheduler", "radixserve.core")
LIST_MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"}
# receivers that name a sequence, for the field names other classes share (token_ids, status, ...)
SEQUENCE_RECEIVER = re.compile(r"^(seq|seqs|sequence|sequences|s|child|children|parent|fork|forks|victim|head|owner|owners"
                               r"|\w+_seqs?)$")


def _class_fields(tree: ast.Module) -> dict[str, set[str]]:
    """class name -> the attribute names it declares (annotations in its body) or assigns on self."""
    fields: dict[str, set[str]] = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        names = fields.setdefault(cls.name, set())
        for node in ast.walk(cls):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return fields


def sequence_fields(modules: dict[str, tuple[str, bool]]) -> tuple[set[str], set[str]]:
    """(every field of Sequence, those no other class of the project declares)."""
    others: set[str] = set()
    mine: set[str] = set()
    for module, (source, _) in modules.items():
        for cls, names in _class_fields(ast.parse(source)).items():
            if module == "radixserve.core" and cls == "Sequence":
                mine = names
            else:
                others |= names
    assert {"token_ids", "num_computed", "block_table", "status"} <= mine
    return mine, mine - others


def _receiver(node: ast.expr) -> str:
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def sequence_writes(module: str, source: str, fields: set[str], unique: set[str]) -> list[str]:
    """'module:line: what' for each assignment to a Sequence field and each change of a Sequence's
    lists (token_ids.append(...), token_ids[i] = ..., del token_ids[i:], ...) in `source`."""
    def names_a_sequence(attr: ast.Attribute) -> bool:
        return attr.attr in unique or (attr.attr in fields and bool(SEQUENCE_RECEIVER.match(_receiver(attr.value))))

    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LIST_MUTATORS:
            targets = [node.func.value]  # seq.token_ids.append(...): the list is what changes
        for target in (t for group in targets for t in (group.elts if isinstance(group, ast.Tuple) else [group])):
            while isinstance(target, ast.Subscript):  # seq.token_ids[i] = ..., del seq.token_ids[i:]
                target = target.value
            if isinstance(target, ast.Attribute) and names_a_sequence(target):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def writes_outside_the_scheduler(modules: dict[str, tuple[str, bool]]) -> list[str]:
    fields, unique = sequence_fields(modules)
    return [w for module, (source, _) in sorted(modules.items())
            if not module.startswith(SEQUENCE_WRITERS) for w in sequence_writes(module, source, fields, unique)]


def test_only_the_scheduler_writes_a_sequence() -> None:
    assert writes_outside_the_scheduler(project_modules()) == []


@pytest.mark.parametrize("planted", [
    "def f(seq):\n    seq.token_ids.append(7)\n",
    "def f(seq):\n    seq.token_ids[-1] = 7\n",
    "def f(seq):\n    del seq.token_ids[3:]\n",
    "def f(req):\n    req.sequences[0].token_ids.extend([1, 2])\n",
    "def f(item):\n    item.seq.num_computed = 4\n",  # a field only Sequence has: any receiver
    "def f(s):\n    s.status, s.finish_reason = None, 'stop'\n",
    "def f(seq):\n    seq.final_token_pending = True\n",
])
def test_a_planted_sequence_write_in_the_engine_is_caught(planted: str) -> None:
    modules = {**project_modules(), "radixserve.engine.planted": (planted, False)}
    assert [w for w in writes_outside_the_scheduler(modules) if w.startswith("radixserve.engine.planted:")]


def test_other_classes_fields_of_the_same_name_are_not_sequence_writes() -> None:
    source = "def f(out, c):\n    out.token_ids.extend([1])\n    c.finish_reason = 'stop'\n"
    assert writes_outside_the_scheduler({**project_modules(), "radixserve.engine.planted": (source, False)}) == []
