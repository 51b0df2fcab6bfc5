"""OpenAI's Responses API: input.py reads a body, store.py builds the prompt from the conversation it
continues and keeps responses, run.py plans and runs one, background.py runs it without its client,
events.py renders bodies and stream events, api.py holds the routes."""
