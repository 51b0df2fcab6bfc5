"""The engine's step stays readable in one screen: the lines of `LLMEngine.step`, `_launch` and
`_resolve` together, and the attributes `LLMEngine.__init__` sets, measured with ast, equal the
figures docs/architecture.md states ("The step's seam for logits features") and stay within the
targets of issue 44 (50 lines, about 15 attributes)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEP_METHODS = ("step", "_launch", "_resolve")
MAX_STEP_LINES, MAX_ATTRIBUTES = 50, 15


def engine_class(source: str) -> ast.ClassDef:
    return next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "LLMEngine")


def methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}


def step_lines(cls: ast.ClassDef) -> int:
    """Lines of the step's three methods, signature and docstring included."""
    found = methods(cls)
    return sum(found[name].end_lineno - found[name].lineno + 1 for name in STEP_METHODS)  # type: ignore[operator]


def init_attributes(cls: ast.ClassDef) -> set[str]:
    """The `self.X` names `__init__` assigns (plain, annotated or unpacked targets)."""
    names: set[str] = set()
    for node in ast.walk(methods(cls)["__init__"]):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            for part in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self":
                    names.add(part.attr)
    return names


def stated(pattern: str) -> int:
    text = (ROOT / "docs" / "architecture.md").read_text()
    match = re.search(pattern, text)
    assert match is not None, f"docs/architecture.md states no figure for {pattern!r}"
    return int(match.group(1))


def test_the_step_and_the_engine_match_the_stated_figures() -> None:
    cls = engine_class((ROOT / "radixserve" / "engine" / "engine.py").read_text())
    lines, attributes = step_lines(cls), len(init_attributes(cls))
    assert lines == stated(r"`step` \+ `_launch` \+ `_resolve`: \*\*(\d+) lines\*\*"), lines
    assert attributes == stated(r"`LLMEngine` attributes set in `__init__`: \*\*(\d+)\*\*"), attributes
    assert lines <= MAX_STEP_LINES and attributes <= MAX_ATTRIBUTES


def test_the_measures_count_what_they_say() -> None:
    source = '''
class LLMEngine:
    def __init__(self) -> None:
        self.a = 1
        self.b: int = 2
        self.c, self.d = 3, 4
        local = self.a

    def step(self) -> None:
        """One."""

    def _launch(self) -> None:
        pass

    def _resolve(self) -> None:
        x = 1
        return None
'''
    cls = engine_class(source)
    assert init_attributes(cls) == {"a", "b", "c", "d"}
    assert step_lines(cls) == 2 + 2 + 3
