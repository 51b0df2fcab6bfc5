"""The bounds on structured-output work: what one grammar may cost to compile, to hold and to match.

Owns `GrammarLimits`, read by the compile workers (engine/grammar/workers.py: process count, time,
memory, native stack), by the engine's own compile (the same stack, doubled) and by every matcher
(llguidance's parser limits). One grammar is one client's request; these keep it from crashing,
stalling or exhausting the server:

- a compile runs first in a worker process, under `worker_memory_mb` of address space, with
  `stack_mb` of native stack on its compile thread, and is killed after `compile_timeout_s`; only a
  grammar that compiled there, and whose first token mask was computed there, is compiled in the
  engine's process (on a thread with twice that stack, so what fit in the worker fits here);
- llguidance's limits are set here, not left to its defaults: `max_lexer_states` bounds a grammar's
  lexer memory (about 1-2 kB a state; llguidance's default of 250,000 would allow ~0.5 GB per cached
  grammar), `step_lexer_fuel` and `step_max_items` bound the work of one token mask, so a mask in
  the engine step costs at most a few milliseconds per constrained row; `verbose_errors` is off, so
  no error carries the parser's state or the grammar text.

Invariants: frozen; every field positive; `parser()` is the one mapping to llguidance's names.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class GrammarLimits:
    workers: int = 2  # compile worker processes: one client's grammars cannot queue everyone's
    cache_mb: float = 128.0  # the compiled grammars kept, by their estimated memory (`estimated_bytes`)
    compile_timeout_s: float = 10.0  # a worker still compiling after this is killed; its request gets a 400
    worker_memory_mb: int = 2048  # a worker's address space (RLIMIT_AS): a grammar past it fails alone
    stack_mb: int = 256  # a worker's compile thread's native stack (long rule chains recurse)
    # llguidance's parser limits (LLParserLimits), per matcher
    max_lexer_states: int = 20_000
    initial_lexer_fuel: int = 200_000  # building the lexer's regexes; llguidance's default, 1M, lets one regex cost ~1 s
    step_lexer_fuel: int = 200_000  # one token mask's lexer work (~14k per ms)
    step_max_items: int = 50_000  # one token mask's Earley items (~20k per ms)
    max_grammar_size: int = 500_000  # symbols in all productions
    max_items_in_row: int = 2_000

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"grammar limit {f.name} must be positive, got {getattr(self, f.name)!r}")

    @staticmethod
    def estimated_bytes(grammar_text: str) -> int:
        """A compiled grammar's memory, from its text: ~90 bytes per byte, measured on the largest
        grammars a request body can carry (10 chains of 5,000 Lark rules, 85 KB each: 74 MB; 10
        schemas of 2,000 patterned properties: 78 MB), plus its first mask's lexer states."""
        return 100 * len(grammar_text) + (1 << 20)

    def parser(self) -> dict[str, Any]:
        """llguidance's LLParserLimits arguments."""
        names = ("max_lexer_states", "initial_lexer_fuel", "step_lexer_fuel", "step_max_items", "max_grammar_size",
                 "max_items_in_row")
        return {**{name: getattr(self, name) for name in names}, "verbose_errors": False}
