"""OpenAI's POST /v1/chat/completions and GET /v1/models: request.py reads a body into an Ask,
api.py streams its plan and renders replies and chunks; tools.py is the OpenAI tool-call shape
(shared by sessions), beam.py vLLM's beam search, shapes.py the pieces OpenAI's endpoints share."""
