"""docs/cli.md is what radixserve.cli_docs renders from the parsers now, so the flag list cannot go stale."""

from __future__ import annotations

import argparse

from radixserve import cli_docs


def test_cli_doc_is_current() -> None:
    rendered = cli_docs.render()
    current = cli_docs.DOC.read_text() if cli_docs.DOC.exists() else ""
    assert current == rendered, (
        f"docs/cli.md is out of date with the command line's parsers: run `{cli_docs.REGENERATE}` "
        "(from the repository root, in the project's venv) and commit the result")


def test_every_flag_of_serve_is_listed() -> None:
    """The page lists each option string of `radixserve serve`, read from the parser `main` parses with."""
    from radixserve.cli import build_parser

    serve = cli_docs._subparsers(build_parser())["serve"]
    flags = {s for a in serve._actions for s in a.option_strings if a.help is not argparse.SUPPRESS} - {"-h", "--help"}
    assert len(flags) > 60
    text = cli_docs.render()
    assert not [f for f in flags if f"`{f}" not in text]
