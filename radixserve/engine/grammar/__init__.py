"""Structured output: constraints compiled with llguidance (`compiler`), applied per sequence (`book`)."""

from radixserve.engine.grammar.book import ConstraintBook, GrammarViolation, StepMasks, apply_token_bitmask
from radixserve.engine.grammar.compiler import CompiledGrammar, GrammarCompiler

__all__ = ["CompiledGrammar", "ConstraintBook", "GrammarCompiler", "GrammarViolation", "StepMasks",
           "apply_token_bitmask"]
