"""The chat front end: chat templates (`template`), tool-call formats and their grammars (`tools/`),
tool use over a reply (`tool_calls`), and the offline multi-turn session (`session`).

A layer of its own below the engine: it imports only core, so the server, the offline `LLM` and the
bench share one definition of how messages become tokens and replies become tool calls.
"""
