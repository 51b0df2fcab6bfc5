"""OpenAI's Responses API: input.py reads a body, store.py builds the prompt from the conversation it
continues and keeps responses, api.py plans and runs it, events.py renders bodies and stream events."""
