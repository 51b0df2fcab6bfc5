"""Server-side chat sessions over REST (rest.py) and WebSocket (ws.py, its outgoing bytes bounded by
send_buffer.py): store.py keeps them, turns.py runs one turn through the pipeline (prepare before
the session's tokenizing, admit in the turn's constructor), tools.py reads a turn's tool fields."""
