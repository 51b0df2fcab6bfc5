"""Compiling structured-output constraints (radixserve/structured.py) into llguidance matchers.

Owns: the model's llguidance tokenizer (built once, on the first compile: it walks the vocabulary),
the compile workers (engine/grammar/workers.py, started on the first compile) and a bounded LRU of
compiled constraints, keyed by the request's cache namespace and the constraint's key (one compiler
serves one tokenizer, so the key is per (constraint, tokenizer)): tenants share no entry, so one
cannot learn from a cache hit what another asked for.

A compile has two halves. A worker process converts the constraint (a GBNF grammar's conversion to
Lark is quadratic), compiles it and computes its first token mask, under the limits of
engine/grammar/limits.py; only a constraint that passed there is compiled in this process, from the
grammar text the worker returned, on a thread with twice the worker's native stack, and its first
mask computed on the template (the lexer states it builds are shared by every copy), so the engine
step never does a constraint's first, most expensive mask.

Invariants:
- a compiled constraint is a template matcher that is never advanced; every sequence gets its own
  copy (`CompiledGrammar.matcher`, a cheap deep copy), so n > 1 forks never share parser state;
- a constraint that fails to compile, crashes or outlasts its worker raises ConstraintError naming
  its API parameter path, in our words, and nothing is cached for it; a grammar that names an EOS
  token is refused (EOS ends a reply; a grammar cannot consume it);
- JSON schemas are compiled with closed objects unless the engine was told otherwise
  (`open_objects`): an object allows only its declared properties (radixserve/schema_objects.py);
- the cache holds at most `cache_size` entries and `limits.cache_mb` of their estimated memory (a
  chain of 5,000 rules holds ~7 MB); a grammar estimated larger than the whole budget is used by its
  request and not kept past its check. An entry compiled ahead of a request's check (`fresh`) is
  evicted last, so the check, which runs on the server's event loop, finds it;
- `evict` drops a grammar whose matcher hit a limit mid-reply, and the memory its lexer built;
- thread-safe: the server compiles on worker threads while the engine thread looks up compiled
  constraints.

Why llguidance: on JSONSchemaBench it compiles more real schemas than xgrammar (76% vs 51%), about
three orders of magnitude faster (ms, not s), and computes a token mask in tens of microseconds; it
also reports forced (fast-forward) tokens, which `ConstraintBook` appends in one step.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from copy import copy
from dataclasses import dataclass, field
from typing import Any

import llguidance

from radixserve.engine.grammar.limits import GrammarLimits
from radixserve.engine.grammar.worker_process import BACKGROUND_NICE
from radixserve.engine.grammar.workers import CompileBusy, CompilePool, CompileRefused
from radixserve.errors import BusyError, ConstraintError
from radixserve.schema_objects import close_objects
from radixserve.structured import StructuredOutput

__all__ = ["CompileStats", "CompiledGrammar", "GrammarCompiler"]
def run_in_background() -> None:
    """This thread below the engine step's priority (Linux: nice is per thread), as the workers are."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


FRESH_KEPT = 16  # entries awaiting their checks kept past the cache's bounds, at most (checks follow at once)
_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is process-wide
TOKEN_REF = re.compile(r"<\[(\^?)([0-9,\s-]*)\]>")  # a grammar's token-id set: <[2]>, <[1-5,9]>, <[^2]>


@dataclass
class CompiledGrammar:
    key: tuple[str, str, str]  # (cache namespace, *StructuredOutput.key)
    template: Any  # llguidance.LLMatcher, never advanced
    compile_s: float
    weight: int = 0  # its estimated memory (GrammarLimits.estimated_bytes)
    # compiled ahead of a request's check (off the server's event loop): that check's lookup is no hit
    fresh: bool = False

    def matcher(self) -> Any:
        """A fresh matcher at the grammar's start, owned by one sequence."""
        return self.template.deep_copy()


@dataclass
class CompileStats:
    compiles: int = 0  # constraints compiled (cache misses that succeeded)
    cache_hits: int = 0
    failures: int = 0  # constraints refused (invalid, unsupported, too slow, too large)
    evictions: int = 0  # grammars dropped because a reply hit a limit
    compile_s_total: float = 0.0
    compile_times_s: list[float] = field(default_factory=list)  # the latest compiles' durations, bounded

    def record(self, seconds: float) -> None:
        self.compiles += 1
        self.compile_s_total += seconds
        self.compile_times_s.append(seconds)
        del self.compile_times_s[:-1024]


def grammar_source(constraint: StructuredOutput, open_objects: bool = False) -> tuple[str, Any]:
    """What a compile worker converts (worker_process.grammar_text): its kind and value."""
    kind = constraint.kind
    if kind == "json":
        schema = constraint.json if constraint.json is not True else {}
        return "json", schema if open_objects else close_objects(schema)
    if kind == "json_object":
        return "json", {"type": "object"}
    if kind == "regex":
        return "regex", constraint.regex
    if kind == "choice":
        return "lark", "start: " + " | ".join(json.dumps(c) for c in constraint.choice or ())
    return "grammar", constraint.grammar


def names_eos(grammar: str, eos_ids: list[int], eos_texts: list[str]) -> bool:
    """Whether a Lark/GBNF grammar names an EOS token, by id (`<[2]>`, a range or a negated set) or by
    its special-token text (`<|im_end|>`)."""
    if any(text and text in grammar for text in eos_texts):
        return True
    for negated, spec in TOKEN_REF.findall(grammar):
        listed: set[int] = set()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            low, _, high = part.partition("-")
            if low.strip().isdigit() and (not high or high.strip().isdigit()):
                listed.update(i for i in eos_ids if int(low) <= i <= int(high or low))
        if bool(listed) != bool(negated):
            return True
    return False


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], cache_size: int = 256,
                 limits: GrammarLimits | None = None, open_objects: bool = False) -> None:
        self._hf_tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self.cache_size, self.limits, self.open_objects = cache_size, limits or GrammarLimits(), open_objects
        self.stats = CompileStats()
        self._cache: OrderedDict[tuple[str, str, str], CompiledGrammar] = OrderedDict()
        self._cached_bytes = 0  # the entries' weights, summed
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._tokenizer_json = ""
        self._parser_limits = llguidance.LLParserLimits(**self.limits.parser())
        self._pool: CompilePool | None = None
        # the in-process halves of compiles: a few long-lived threads with twice a worker's stack (threads
        # made per compile left their freed memory scattered over malloc arenas: RSS grew with every one)
        self._threads = ThreadPoolExecutor(self.limits.workers, thread_name_prefix="radixserve-grammar",
                                           initializer=run_in_background)

    @property
    def ll_tokenizer(self) -> Any:
        """The llguidance view of the model's tokenizer (built on first use: ~0.4 s for 49k tokens)."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                if self._hf_tokenizer is None:
                    raise ConstraintError("structured_outputs", "this model has no tokenizer to constrain output with")
                try:  # as llguidance.hf.from_tokenizer does it, keeping the JSON for the compile workers
                    backend = copy(self._hf_tokenizer.backend_tokenizer)
                    backend.no_padding()
                    backend.no_truncation()
                    self._tokenizer_json = backend.to_str()
                    self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                                eos_token=self.eos_token_ids or None)
                except Exception as e:  # a slow (non-Rust) tokenizer: llguidance reads only fast ones
                    raise ConstraintError("structured_outputs",
                                          f"this model's tokenizer cannot drive structured output ({e})") from None
            return self._ll_tokenizer

    @property
    def pool(self) -> CompilePool:
        tokenizer = self.ll_tokenizer
        with self._tokenizer_lock:
            if self._pool is None:
                self._pool = CompilePool({"tokenizer": self._tokenizer_json, "n_vocab": self.vocab_size,
                                          "eos": tokenizer.eos_tokens}, self.limits)
            return self._pool

    def is_cached(self, constraint: StructuredOutput, namespace: str = "") -> bool:
        """Whether the constraint is compiled (a look only: nothing is counted or reordered)."""
        with self._lock:
            return (namespace, *constraint.key) in self._cache

    def cached(self, constraint: StructuredOutput, count_hit: bool = True, namespace: str = "") -> CompiledGrammar | None:
        """The compiled constraint if it is in the cache, else None. A hit is counted unless told not
        to, or unless the constraint was compiled ahead of this very lookup (`compile(for_a_check=True)`)."""
        key = (namespace, *constraint.key)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += count_hit and not hit.fresh
                hit.fresh = False
            return hit

    def ensure(self, constraint: StructuredOutput, namespace: str = "") -> CompiledGrammar:
        """`compile` for a request that was already checked: a hit is not counted again."""
        return self.cached(constraint, False, namespace) or self.compile(constraint, namespace=namespace)

    def compile(self, constraint: StructuredOutput, for_a_check: bool = False, namespace: str = "") -> CompiledGrammar:
        """The compiled constraint, from the cache or compiled now; ConstraintError if it cannot be,
        BusyError if no compile worker came free in time. `for_a_check`: compiled ahead of a request's
        check (the server does so off its event loop), whose lookup then counts as this compile, not
        as a cache hit."""
        hit = self.cached(constraint, namespace=namespace)
        if hit is not None:
            return hit
        try:
            compiled = self._compile(constraint, (namespace, *constraint.key))
        except (ConstraintError, BusyError):
            with self._lock:
                self.stats.failures += 1
            raise
        compiled.fresh = for_a_check
        with self._lock:
            self.stats.record(compiled.compile_s)
            # one compiled for a check is kept until that check's lookup, whatever its size: the check
            # runs on the server's event loop and must not compile
            fits = for_a_check or compiled.weight <= self.limits.cache_mb * 2**20
            if fits and compiled.key not in self._cache:
                self._cache[compiled.key] = compiled
                self._cached_bytes += compiled.weight
                self._trim()
        return compiled

    def _compile(self, constraint: StructuredOutput, key: tuple[str, str, str]) -> CompiledGrammar:
        tokenizer = self.ll_tokenizer
        kind, value = grammar_source(constraint, self.open_objects)
        if kind == "grammar":
            eos_texts = self._hf_tokenizer.convert_ids_to_tokens(self.eos_token_ids) if self.eos_token_ids else []
            if names_eos(str(value), self.eos_token_ids, [str(t) for t in eos_texts]):
                raise ConstraintError(constraint.field, "a grammar may not name the end-of-sequence token "
                                      f"({', '.join(map(str, eos_texts))}): the reply ends where the grammar does")
        try:
            answer = self.pool.run(kind, value)
        except CompileRefused as e:
            raise ConstraintError(constraint.field, f"this {constraint.kind} {e}") from None
        except CompileBusy:
            raise BusyError("every grammar compile worker is busy; try again shortly") from None
        if "refused" in answer:
            raise ConstraintError(constraint.field, str(answer["refused"]))

        def compile_here() -> Any:  # what compiled in a worker compiles here, on twice its stack
            matcher = llguidance.LLMatcher(tokenizer, answer["grammar"], log_level=0, limits=self._parser_limits)
            if not matcher.is_error():
                matcher.compute_bitmask()  # the first mask, off the step; its lexer states serve every copy
            return matcher
        template = self._on_big_stack(compile_here)
        if template.is_error():  # the worker passed it: not expected
            raise ConstraintError(constraint.field, f"this {constraint.kind} could not be compiled")
        return CompiledGrammar(key, template, float(answer["compile_s"]), self.limits.estimated_bytes(answer["grammar"]))

    def _trim(self) -> None:
        """Evict least recently used entries past the cache's size or memory; entries waiting for their
        check's lookup (`fresh`) go last."""
        budget = self.limits.cache_mb * 2**20
        while len(self._cache) > self.cache_size or self._cached_bytes > budget:
            key = next((k for k, g in self._cache.items() if not g.fresh), None)
            if key is None:  # only entries awaiting their checks: kept, unless a flood of them
                if len(self._cache) <= FRESH_KEPT:
                    return
                key = next(iter(self._cache))
            self._cached_bytes -= self._cache.pop(key).weight

    def evict(self, key: tuple[str, str, str]) -> None:
        """Drop a grammar whose matcher hit a limit, so the lexer states it built are freed once its
        request ends (a request that asks for it again compiles it again)."""
        with self._lock:
            dropped = self._cache.pop(key, None)
            if dropped is not None:
                self._cached_bytes -= dropped.weight
                self.stats.evictions += 1

    def _on_big_stack(self, work: Callable[[], Any]) -> Any:
        """`work()` on one of the compile threads, whose native stack is twice a worker's."""
        with _STACK_SIZE_LOCK:  # a thread the executor starts now takes this size
            previous = threading.stack_size(2 * self.limits.stack_mb << 20)
            try:
                future = self._threads.submit(work)
            finally:
                threading.stack_size(previous)
        return future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        self._threads.shutdown(wait=False, cancel_futures=True)

