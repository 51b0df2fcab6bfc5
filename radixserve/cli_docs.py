"""docs/cli.md, rendered from the command line's own parsers.

    python -m radixserve.cli_docs            # rewrite docs/cli.md
    python -m radixserve.cli_docs --check    # exit 1 if docs/cli.md differs from what this renders

The parsers are the entry points' own (`radixserve.cli.build_parser`, `radixserve_bench.cli.build_parser`,
and each pass-through check's `add_arguments`). The benchmark is imported lazily; where it cannot be
imported the page says so instead of listing its flags. tests/test_cli_docs.py keeps the page current.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "cli.md"
REGENERATE = "python -m radixserve.cli_docs"
BENCH_PACKAGE = "radixserve_bench"  # the benchmark's own package, installed from the checkout


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _subcommand_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def _portable(text: str) -> str:
    """Paths of this checkout and this user written as on any machine: `web`, `~/.cache/...`."""
    return text.replace(str(ROOT) + "/", "").replace(str(ROOT), ".").replace(str(Path.home()), "~")


def _cell(text: str) -> str:
    text = " ".join(_portable(text).split())
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _flag(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ", ".join(f"`{s}`" for s in action.option_strings)
    if action.metavar is not None:
        arg = str(action.metavar)
    elif action.choices is not None:
        arg = "{" + ",".join(str(c) for c in action.choices) + "}"
    else:
        arg = action.dest.upper()
    if not action.option_strings:
        return f"`{arg}`" + (" ..." if action.nargs in ("+", "*") else "")
    return ", ".join(f"`{s} {arg}`" for s in action.option_strings)


def _default(action: argparse.Action) -> str:
    d = action.default
    if isinstance(d, (list, tuple)):
        d = ",".join(str(x) for x in d)
    if action.nargs == 0 or d is None or d is argparse.SUPPRESS or d == "":
        return ""
    return f"`{_portable(str(d))}`"


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help:
        return ""
    return _cell(parser._get_formatter()._expand_help(action))  # argparse's own %(default)s expansion


def _groups(parser: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    out = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help is not argparse.SUPPRESS
                   and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        if actions:
            out.append((group.title or "options", actions))
    return out


def _anchor(title: str) -> str:
    keep = "".join(c for c in title.lower() if c.isalnum() or c in " -")
    return keep.replace(" ", "-")


def render_command(name: str, parser: argparse.ArgumentParser, summary: str, seen: dict[tuple[str, ...], str],
                   lines: list[str]) -> None:
    """One command: its summary, then a table per argument group (a group already shown is linked)."""
    lines += [f"## `{name}`", ""]
    if summary:
        text = _cell(summary)
        lines += [text[0].upper() + text[1:] + ("" if text.endswith(".") else "."), ""]
    groups = _groups(parser)
    if not groups:
        lines += ["No flags.", ""]
    for title, actions in groups:
        key = (title, *(a.dest + ":" + ",".join(a.option_strings) + ":" + _help(parser, a) for a in actions))
        heading = f"{name}: {title}"
        if key in seen:
            lines += [f"**{title}**: the same {len(actions)} flags as [{seen[key]}](#{_anchor(seen[key])}).", ""]
            continue
        seen[key] = heading
        lines += [f"### {heading}", "", "| flag | default | what it does |", "| --- | --- | --- |"]
        lines += [f"| {_flag(a)} | {_default(a)} | {_help(parser, a)} |" for a in actions]
        lines.append("")


def _importable(module: str) -> tuple[Any, str]:
    """The module, or None and why it could not be imported here."""
    try:
        return importlib.import_module(module), ""
    except ImportError as e:
        return None, f"{module}: {e}"


def _is_passthrough(parser: argparse.ArgumentParser) -> bool:
    """A subcommand that hands every word to a parser of its own (`bench kernels`, the checks)."""
    return any(a.nargs == argparse.REMAINDER and a.help is argparse.SUPPRESS for a in parser._actions)


def _passthrough_parser(name: str) -> tuple[argparse.ArgumentParser | None, str]:
    """The parser of a pass-through subcommand: the kernel benchmark, or one of the checks (each
    module has `add_arguments(parser)`)."""
    if name == "kernels":
        module_name = f"{BENCH_PACKAGE}.kernel_bench"
    else:
        from radixserve_bench.checks import CHECKS

        if name not in CHECKS:
            return None, f"{name} is not in {BENCH_PACKAGE}.checks"
        module_name = f"{BENCH_PACKAGE}.checks.{CHECKS[name].module}"
    module, why = _importable(module_name)
    if module is None:
        return None, why
    parser = argparse.ArgumentParser(prog=f"radixserve bench {name}")
    module.add_arguments(parser)
    return parser, ""


def render() -> str:
    from radixserve.cli import build_parser

    top = build_parser()
    commands = _subparsers(top)
    summaries = _subcommand_help(top)
    lines = [
        f"<!-- generated by `{REGENERATE}` from the argparse parsers; do not edit by hand -->",
        "# Command line",
        "",
        "Every flag of `radixserve` and its subcommands, as `--help` prints them. A flag with no default shown",
        "is off, or takes its value from the machine or the model (its text says which).",
        f"This page is generated: run `{REGENERATE}` after changing a parser; `tests/test_cli_docs.py` fails",
        "while it is out of date. What the server does with its flags: [server.md](server.md); benchmarks:",
        "[bench.md](bench.md).",
        "",
    ]
    body: list[str] = []
    seen: dict[tuple[str, ...], str] = {}
    for name in ("serve", "chat", "generate"):
        render_command(f"radixserve {name}", commands[name], summaries.get(name, ""), seen, body)
    bench, why = _importable(f"{BENCH_PACKAGE}.cli")
    if bench is None:
        body += ["## `radixserve bench`", "",
                 f"Not listed: the benchmark's command line could not be imported here ({_cell(why)}).", ""]
    else:
        bench_top = bench.build_parser()
        bench_summaries = _subcommand_help(bench_top)
        render_command("radixserve bench", bench_top, "`run` is the default subcommand: `radixserve bench` takes "
                       "the flags of `radixserve bench run`", seen, body)
        for name, sub in _subparsers(bench_top).items():
            if _is_passthrough(sub):  # its flags belong to a module imported only when it runs
                own, why = _passthrough_parser(name)
                if own is None:
                    body += [f"## `radixserve bench {name}`", "",
                             f"Its flags are not listed: its module could not be imported here ({_cell(why)}).", ""]
                    continue
                sub = own
            render_command(f"radixserve bench {name}", sub, bench_summaries.get(name, ""), seen, body)
    toc = [f"- [`{line[4:-1]}`](#{_anchor(line[3:])})" for line in body if line.startswith("## `")]
    return "\n".join(lines + toc + [""] + body).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m radixserve.cli_docs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare docs/cli.md with the rendering; write nothing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = DOC.read_text() if DOC.exists() else ""
        if current != text:
            print(f"docs/cli.md is out of date: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
