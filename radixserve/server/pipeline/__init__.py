"""The one generation pipeline every API uses: an API's parser reads its body into an `Ask`
(ask.py), and `plan → admit → stream` turns it into engine outputs.

- ask.py: `Ask`, the API-neutral request (prompt or messages, typed sampling fields, tools,
  logprob budget, tenant and cache salt, priority, stream options, n).
- plan.py: `plan` (tokenize, prompt limits, logprob caps, prediction tokenized, structured output
  compiled off the event loop), `admit` (SamplingParams built, the engine's one check), `Plan.stream`.
- stream.py: `stream_request` (engine outputs, errors as ApiErrors, metrics once per request) and
  `SystemPromptRef` (the per-tenant system-prompt figures).
- The pieces each step uses: sampling.py (SamplingFields read and made SamplingParams),
  structured.py (structured-output fields, `compile_off_loop`), compile_slots.py, prediction.py
  (`prediction` and the speculation figures), logprobs.py (logprob bodies and caps),
  prompt_worker.py (tokenizing off the event loop), reasoning.py (template variables, earlier reasoning
  sent back, the served model's reasoning format; a reply is read by `Plan.reader`).

Invariant: no module here depends on which API a request came from, and no API re-implements a step.
"""
