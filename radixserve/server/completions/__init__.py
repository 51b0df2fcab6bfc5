"""OpenAI's legacy POST /v1/completions, as vLLM serves it: request.py reads a body into an Ask of
text prompts, api.py runs every prompt's plan and renders choices; logprobs.py is the legacy
`logprobs` object and vLLM's `prompt_logprobs` lists (chat's prompt_logprobs too)."""
