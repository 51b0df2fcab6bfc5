"""The speculation workloads' sessions (regenerate, edit; their parameters are in workloads.py) and
their texts, deterministic by seed, built with no network: small Python functions generated from
templates (names and constants drawn by the seed), real English from the chitchat text source, and
the edit requests made of them. Prompts are chat requests (one user message, rendered by `chat`).

An edit request asks the model to return a given text with a small change, so its reply repeats most
of that text: rename a variable in a function, fix the one typo put into a function, or fix the
typos put into a piece of prose. `EditTask.original` is the text exactly as the prompt shows it (the
typos included): what an editor would send as OpenAI's `prediction`. A regenerate request asks for
the next message of a real conversation excerpt.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from radixserve_bench.systems.base import GREEDY, Sampling
from radixserve_bench.textsource import conversation_texts
from radixserve_bench.workloads import EditParams, EditPredictionParams, Encode, RegenerateParams, Session, Turn

EDIT_KINDS = ("rename", "typo", "prose")

# {f}: the function's name; {a}, {b}: its parameters; {x}, {y}, {z}: locals; {n}: a small constant
_TEMPLATES = (
    '''def {f}({a}, {b}):
    """Return the moving averages of {a} over windows of {b} items."""
    {x} = []
    {y} = 0.0
    for {z}, value in enumerate({a}):
        {y} += value
        if {z} >= {b}:
            {y} -= {a}[{z} - {b}]
        if {z} + 1 >= {b}:
            {x}.append({y} / {b})
    return {x}
''',
    '''def {f}({a}, {b}={n}):
    """Count the words of {a} and return the {b} most common, most frequent first."""
    {x} = {{}}
    for {y} in {a}.lower().split():
        {y} = {y}.strip(".,!?;:")
        if {y}:
            {x}[{y}] = {x}.get({y}, 0) + 1
    {z} = sorted({x}.items(), key=lambda item: (-item[1], item[0]))
    return {z}[:{b}]
''',
    '''def {f}({a}, {b}):
    """Return the index of {b} in the sorted list {a}, or -1 when it is absent."""
    {x}, {y} = 0, len({a}) - 1
    while {x} <= {y}:
        {z} = ({x} + {y}) // 2
        if {a}[{z}] == {b}:
            return {z}
        if {a}[{z}] < {b}:
            {x} = {z} + 1
        else:
            {y} = {z} - 1
    return -1
''',
    '''def {f}({a}, {b}="="):
    """Parse lines of "key{b}value" pairs into a dict, skipping blanks and comments."""
    {x} = {{}}
    for {y} in {a}.splitlines():
        {y} = {y}.strip()
        if not {y} or {y}.startswith("#"):
            continue
        {z}, _, value = {y}.partition({b})
        {x}[{z}.strip()] = value.strip()
    return {x}
''',
    '''def {f}({a}, {b}={n}):
    """Split {a} into chunks of at most {b} items, keeping their order."""
    if {b} < 1:
        raise ValueError("chunk size must be at least 1")
    {x} = []
    for {y} in range(0, len({a}), {b}):
        {z} = {a}[{y}:{y} + {b}]
        {x}.append({z})
    return {x}
''',
    '''def {f}({a}, {b}=""):
    """Flatten the nested dict {a} into one level, joining keys with dots."""
    {x} = {{}}
    for {y}, value in {a}.items():
        {z} = f"{{{b}}}.{{{y}}}" if {b} else {y}
        if isinstance(value, dict):
            {x}.update({f}(value, {z}))
        else:
            {x}[{z}] = value
    return {x}
''',
)
_FUNCTIONS = ("moving_average", "top_words", "find_index", "parse_pairs", "chunked", "flatten", "summarize",
              "collect", "process", "compute")
_PARAMS = ("items", "data", "values", "text", "records", "source", "entries", "lines")
_SECOND = ("size", "limit", "target", "sep", "width", "prefix", "count", "step")
_LOCALS = ("result", "total", "index", "current", "low", "high", "word", "counts", "key", "line", "chunk", "acc",
           "buffer", "pos", "ranked", "mid", "out", "seen")
_TYPOS = (("return", "retrun"), ("append", "apend"), ("else", "esle"), ("value", "vaule"), ("strip", "stirp"),
          ("items", "itmes"), ("len(", "lne("), ("range", "rnage"))


@dataclass(frozen=True)
class EditTask:
    kind: str  # one of EDIT_KINDS
    instruction: str  # the user message: the request and the text
    original: str  # the text as the prompt shows it (the prediction an editor would send)


def code_snippet(rng: random.Random, min_tokens: int, count: Callable[[str], int]) -> tuple[str, list[str]]:
    """Python functions from the templates, with names drawn by `rng`, until `count` (the model's
    token count of a text) reaches `min_tokens`; the text and the local variable names it uses."""
    parts: list[str] = []
    locals_used: list[str] = []
    functions = rng.sample(_FUNCTIONS, len(_FUNCTIONS))  # no name twice in one text
    while not parts or count("\n".join(parts)) < min_tokens:
        names = rng.sample(_LOCALS, 3)
        template = rng.choice(_TEMPLATES)
        parts.append(template.format(f=functions[len(parts) % len(functions)], a=rng.choice(_PARAMS), b=rng.choice(_SECOND),
                                     x=names[0], y=names[1], z=names[2], n=rng.randint(2, 9)))
        locals_used += names
    return "\n".join(parts), locals_used


def prose(stream: list[str], min_tokens: int, count: Callable[[str], int]) -> str:
    """Real messages taken off `stream` (consumed) until `count` reaches `min_tokens`."""
    lines: list[str] = []
    while stream and (not lines or count("\n".join(lines)) < min_tokens):
        lines.append(stream.pop(0))
    return "\n".join(lines)


def add_typos(rng: random.Random, text: str, every: int = 12) -> str:
    """One word in about `every` with two neighbouring letters swapped (words of 4+ letters)."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) >= 4 and w.isalpha() and rng.randrange(every) == 0:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def add_code_typo(rng: random.Random, code: str) -> str:
    """The code with one occurrence of a keyword or name misspelt (the first candidate it holds)."""
    candidates = [pair for pair in _TYPOS if pair[0] in code]
    right, wrong = rng.choice(candidates) if candidates else ("def", "dfe")
    starts = [m.start() for m in re.finditer(re.escape(right), code)]
    at = rng.choice(starts)
    return code[:at] + wrong + code[at + len(right):]


def edit_task(kind: str, rng: random.Random, messages: list[str], min_tokens: int,
              count: Callable[[str], int]) -> EditTask:
    if kind == "prose":
        text = add_typos(rng, prose(messages, min_tokens, count))
        return EditTask(kind, f"Fix the typos in this text and return the whole corrected text:\n\n{text}", text)
    code, names = code_snippet(rng, min_tokens, count)
    if kind == "rename":
        old = names[0]
        new = rng.choice([n for n in _LOCALS if n not in names]) + "_value"
        return EditTask(kind, f"Rename the variable `{old}` to `{new}` in this code and return the whole code:\n\n"
                              f"```python\n{code}```", code)
    code = add_code_typo(rng, code)
    return EditTask(kind, f"Fix the typo in this code and return the whole code:\n\n```python\n{code}```", code)


def edit_tasks(n: int, seed: int, min_tokens: int, count: Callable[[str], int]) -> list[EditTask]:
    """`n` edit requests, kinds in turn (rename, typo, prose, rename, ...), the same for the same seed."""
    rng = random.Random(f"edit:{seed}")
    texts = conversation_texts(seed)
    messages: list[str] = []
    tasks = []
    for i in range(n):
        while len(messages) < 64:
            messages += [m for m in next(texts).splitlines() if m.strip()]
        tasks.append(edit_task(EDIT_KINDS[i % len(EDIT_KINDS)], rng, messages, min_tokens, count))
    return tasks


def regenerate_prompts(n: int, seed: int, min_tokens: int, count: Callable[[str], int]) -> list[str]:
    """`n` chat requests: a real conversation excerpt of about `min_tokens` tokens, then asking for
    the next message."""
    texts = conversation_texts(seed)
    out = []
    for _ in range(n):
        messages = [m for m in next(texts).splitlines() if m.strip()]
        while count("\n".join(messages)) < min_tokens:
            messages += [m for m in next(texts).splitlines() if m.strip()]
        excerpt = prose(messages, min_tokens, count)
        out.append(f"Here is a chat between two friends:\n\n{excerpt}\n\nWrite the next message of this chat.")
    return out


def regenerate_sessions(p: RegenerateParams, encode: Encode, chat: Encode, seed: int) -> list[Session]:
    """Each session asks one chat request `asks` times: every later ask re-sends the first prompt alone
    (no history), as a regenerate button does; sampled asks each get their own seed."""
    sessions = []
    for i, text in enumerate(regenerate_prompts(p.sessions, seed, p.prompt_len, lambda t: len(encode(t)))):
        prompt = tuple(chat(text))
        turns = tuple(Turn(prompt, p.output_len, history=False,
                           sampling=Sampling(p.temperature, seed=None if p.temperature == 0 else 1000 * i + k))
                      for k in range(p.asks))
        sessions.append(Session(f"rg-{i}", i, turns))
    return sessions


def edit_sessions(p: EditParams, encode: Encode, chat: Encode, seed: int) -> list[Session]:
    """One chat request per session: rewrite a text with a small change; the output is the text's length
    plus `output_extra`; for edit-prediction the original text (as the model's tokens) is the prediction."""
    sessions = []
    for i, task in enumerate(edit_tasks(p.requests, seed, p.text_len, lambda t: len(encode(t)))):
        original = tuple(encode(task.original))
        sampling = Sampling(prediction=original) if isinstance(p, EditPredictionParams) else GREEDY
        turn = Turn(tuple(chat(task.instruction)), len(original) + p.output_extra, sampling=sampling)
        sessions.append(Session(f"ed-{task.kind}-{i}", i, (turn,)))
    return sessions
