"""The Anthropic Messages API: request.py reads a /v1/messages body into an Ask, api.py streams its
plan, reply.py renders content blocks and stream events, heartbeat.py paces the keep-alive pings of a
quiet stream, tools.py Anthropic's tool shapes, cache_control.py the system-prompt pins `cache_control`
asks for."""
