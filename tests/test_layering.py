"""Layering as a test: every module's imports (read with ast) must follow the layer table below, which
must equal the layer picture in the README. Data flows one way — web → server → engine → scheduler →
cache → core, the engine also → model → kernels — and nothing imports upward.

Imports under `if TYPE_CHECKING:` are exempt: they are annotations only (core names the radix tree's
node type that way) and create no dependency at run time.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("radixserve", "radixserve_bench")

# module (or package prefix) -> layer; the longest matching prefix wins
LAYER_OF = {
    "radixserve.core": "core",
    "radixserve.config": "core",
    "radixserve.errors": "core",
    "radixserve.sampling_params": "core",
    "radixserve.sampling_fields": "core",
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
    "radixserve_bench": "bench",  # the top-level benchmark package beside the runtime
    "radixserve.scaleout": "scaleout",
    "radixserve": "entry",  # the package's public names, cli.py, terminal_chat.py
}
ALL_LAYERS = ("entry", "scaleout", "server", "bench", "engine", "chat", "scheduler", "model", "cache", "core", "kernels")
# layer -> the other layers it may import (its own is always allowed)
MAY_IMPORT = {
    "entry": {"scaleout", "server", "bench", "engine", "chat", "scheduler", "model", "cache", "core", "kernels"},
    "scaleout": {"server", "engine", "chat", "cache", "core"},
    "server": {"engine", "chat", "core"},
    # the bench sits beside the runtime and drives it: a server it starts in-process (the agent bench
    # watches that server's engine steps) as much as an engine; the runtime never imports the bench
    "bench": {"scaleout", "server", "engine", "chat", "scheduler", "cache", "model", "core", "kernels"},
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
    ("radixserve.chat.synthetic", "from radixserve.engine import LLM\n"),  # chat sits below the engine
    ("radixserve.chat.synthetic", "from radixserve.server.app import build_app\n"),
    ("radixserve.kernels.synthetic", "from radixserve.model.attention import AttentionMetadata\n"),
    ("radixserve.model.synthetic", "from radixserve.chat.template import ChatFormatter\n"),  # model knows no chat
    ("radixserve.engine.synthetic", "import radixserve_bench.micro\n"),  # the runtime never imports the bench
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


# -- one writer of each piece of shared state -------------------------------------------------------
# Who may change what (the test reads every module with ast; a write is an assignment, augmented
# assignment or `del` of a field, a change to one of its lists or dicts, or, for the tree, a call of a
# method that changes the cache):
# - a `Sequence` and a `Request` (core.py): their fields only in scheduler/ (and core.py, which defines
#   them). A request's `timing` and `drafts` are records of their own that the engine fills: writing a
#   field of `req.timing` is no Request write, replacing `req.timing` is.
# - a `RadixNode`: its fields only in cache/ (the tree writes its nodes; the scheduler, too, changes
#   them only through the tree's methods).
# - the `RadixTree`: its fields, and every method that changes the cache, only in scheduler/ and
#   cache/. A public method changes the cache unless its docstring says "A query"; `match` is a query
#   when called with split=False.
# A field or method name no other class of the project declares (nor a built-in container, str or re)
# counts on any receiver; a shared one (`tokens`, `insert`, `events`, ...) only on a receiver whose name
# says what it is (`seq`, `req`, `node`, `tree`, ... below). The micro-benchmarks of the scheduler and
# the tree build and drive them directly, as tests do (DRIVERS).
DRIVERS = ("radixserve_bench.micro",)
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "update", "setdefault", "popitem"}
# receivers that name a sequence, for the field names other classes share (token_ids, status, ...)
SEQUENCE_RECEIVER = re.compile(r"^(seq|seqs|sequence|sequences|s|child|children|parent|fork|forks|victim|head|owner|owners"
                               r"|\w+_seqs?)$")
BUILTIN_NAMES = {name for kind in (list, dict, set, str) for name in dir(kind)} | set(dir(re))


@dataclass(frozen=True)
class Guarded:
    module: str  # where the class is defined
    cls: str
    writers: tuple[str, ...]  # the module prefixes that may change it
    receiver: re.Pattern[str]  # names that say an expression is one (for names other classes share)
    methods: bool = False  # are its cache-changing method calls writes too?


GUARDED = (
    Guarded("radixserve.core", "Sequence", ("radixserve.scheduler", "radixserve.core"), SEQUENCE_RECEIVER),
    Guarded("radixserve.core", "Request", ("radixserve.scheduler", "radixserve.core"),
            re.compile(r"^(req|reqs|request|requests|\w+_req|\w+_request)$")),
    Guarded("radixserve.cache.radix_tree", "RadixNode", ("radixserve.cache",),
            re.compile(r"^(node|nodes|\w+_node|\w+_nodes|root|roots)$")),
    Guarded("radixserve.cache.radix_tree", "RadixTree", ("radixserve.scheduler", "radixserve.cache"),
            re.compile(r"^(tree|trees|radix_tree|\w+_tree)$"), methods=True),
)


@dataclass(frozen=True)
class Shape:
    """What the test reads from a guarded class's source."""

    fields: set[str]
    unique_fields: set[str]  # fields no other class declares: a write on any receiver counts
    changing: set[str]  # public methods whose docstring does not say "A query"
    unique_changing: set[str]


def _members(cls: ast.ClassDef) -> tuple[set[str], dict[str, str]]:
    """(the attribute names a class declares (annotations in its body) or assigns on self, its methods
    and their docstrings)."""
    fields = {node.target.id for node in cls.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            fields.add(node.attr)
    methods = {f.name: ast.get_docstring(f) or "" for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return fields, methods


def shapes(parsed: dict[str, ast.Module]) -> dict[str, Shape]:
    """Guarded class name -> its shape, with uniqueness judged against every other class of the project."""
    members: dict[tuple[str, str], tuple[set[str], dict[str, str]]] = {}
    for module, tree in parsed.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            members[(module, cls.name)] = _members(cls)
    out = {}
    for g in GUARDED:
        fields, methods = members[(g.module, g.cls)]
        others = BUILTIN_NAMES.union(*(f | set(m) for key, (f, m) in members.items() if key != (g.module, g.cls)))
        changing = {name for name, doc in methods.items() if g.methods and not name.startswith("_")
                    and "A query" not in doc}
        out[g.cls] = Shape(fields, fields - others, changing, changing - others)
    assert {"token_ids", "num_computed", "block_table", "status"} <= out["Sequence"].fields
    assert {"sequences", "cached_tokens", "queued_at"} <= out["Request"].fields
    assert {"children", "blocks", "lock_count", "hold_count"} <= out["RadixNode"].fields
    assert {"insert", "match", "hold", "release_hold", "lock", "evict", "clear"} <= out["RadixTree"].changing
    assert not {"continuation", "nodes", "root_of", "check_integrity"} & out["RadixTree"].changing
    return out


def _receiver(node: ast.expr) -> str:
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _is_query_match(call: ast.Call) -> bool:
    """tree.match(tokens, split=False) (or False as its second argument): a lookup that changes nothing."""
    split = [k.value for k in call.keywords if k.arg == "split"] + call.args[1:2]
    return bool(split) and isinstance(split[0], ast.Constant) and split[0].value is False


def writes_in(module: str, tree: ast.Module, guarded: Guarded, shape: Shape) -> list[str]:
    """'module:line: what' for each write to a `guarded` object in the module (see the rules above)."""
    def names_it(attr: ast.Attribute, unique: set[str]) -> bool:
        return attr.attr in unique or bool(guarded.receiver.match(_receiver(attr.value)))

    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in MUTATORS:
                targets = [node.func.value]  # seq.token_ids.append(...): the list is what changes
            if node.func.attr in shape.changing and names_it(node.func, shape.unique_changing) \
                    and not (node.func.attr == "match" and _is_query_match(node)):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)[:80]}")
        for target in (t for group in targets for t in (group.elts if isinstance(group, ast.Tuple) else [group])):
            while isinstance(target, ast.Subscript):  # seq.token_ids[i] = ..., del node.children[t]
                target = target.value
            if isinstance(target, ast.Attribute) and target.attr in shape.fields and names_it(target, shape.unique_fields):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


@functools.cache
def _parse(source: str) -> ast.Module:
    """A module's syntax tree, parsed once for all the tests below (which only read it)."""
    return ast.parse(source)


def writes_outside_their_writers(modules: dict[str, tuple[str, bool]], only: str | None = None) -> list[str]:
    """Every write to a guarded object (of class `only`, or of any) outside the modules that may make it."""
    parsed = {module: _parse(source) for module, (source, _) in modules.items()}
    known = shapes(parsed)
    found = []
    for guarded in (g for g in GUARDED if only in (None, g.cls)):
        found += [f"{w} ({guarded.cls})" for module, tree in sorted(parsed.items())
                  if not module.startswith(guarded.writers + DRIVERS)
                  for w in writes_in(module, tree, guarded, known[guarded.cls])]
    return found


def test_only_their_writers_change_sequences_requests_and_the_tree() -> None:
    assert writes_outside_their_writers(project_modules()) == []


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
    assert [w for w in writes_outside_their_writers(modules, "Sequence") if w.startswith("radixserve.engine.planted:")]


@pytest.mark.parametrize(("cls", "planted"), [
    ("RadixTree", "def f(engine, tokens):\n    engine.tree.match(tokens, namespace='')\n"),  # splits: a write
    ("RadixTree", "def f(self, node):\n    self.tree.hold(node)\n"),
    ("RadixTree", "def f(tree, node):\n    tree.release_hold(node)\n"),
    ("RadixTree", "def f(engine, log):\n    engine.tree.events = log\n"),
    ("RadixTree", "def f(tree, tokens, blocks):\n    tree.insert(tokens, blocks)\n"),
    ("RadixTree", "def f(cache, match):\n    cache.load_back(match)\n"),  # a method only the tree has: any receiver
    ("RadixTree", "def f(engine):\n    engine.tree.roots.pop('x')\n"),
    ("RadixNode", "def f(pin):\n    pin.node.hold_count += 1\n"),
    ("RadixNode", "def f(match):\n    match.node.blocks.append(3)\n"),
    ("RadixNode", "def f(node):\n    del node.children[5]\n"),
    ("Request", "def f(req, seq):\n    req.sequences.append(seq)\n"),
    ("Request", "def f(seq):\n    seq.request.cached_tokens = 0\n"),
    ("Request", "def f(x):\n    x.queued_at = 0.0\n"),  # a field only Request has: any receiver
])
def test_a_planted_tree_or_request_write_in_the_engine_is_caught(cls: str, planted: str) -> None:
    modules = {**project_modules(), "radixserve.engine.planted": (planted, False)}
    assert [w for w in writes_outside_their_writers(modules, cls) if w.startswith("radixserve.engine.planted:")]


def test_a_node_write_in_the_scheduler_is_caught() -> None:
    """The scheduler changes the tree through its methods only: a node's fields are the tree's."""
    modules = {**project_modules(), "radixserve.scheduler.planted": ("def f(seq):\n    seq.locked_node.lock_count = 0\n", False)}
    assert [w for w in writes_outside_their_writers(modules, "RadixNode") if w.startswith("radixserve.scheduler.planted:")]


def test_reads_queries_and_other_classes_fields_of_the_same_name_are_not_writes() -> None:
    source = ("def f(out, c, edge, tree, engine, req, node, tokens):\n"
              "    out.token_ids.extend([1])\n    c.finish_reason = 'stop'\n"  # outputs' fields, not a sequence's
              "    edge.children[3] = edge\n    edge.tokens = []\n"  # another trie's edges (scaleout)
              "    tree.match(tokens, split=False)\n    engine.tree.continuation(tokens, 4)\n"  # queries
              "    tree.nodes()\n    req.timing.arrival = 1.0\n    req.drafts.add('tree', 1, 1)\n"  # the request's own records
              "    print(node.blocks, req.sequences[0].token_ids)\n")
    assert writes_outside_their_writers({**project_modules(), "radixserve.engine.planted": (source, False)}) == []
