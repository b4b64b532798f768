"""The OpenAI wire format: request bodies validated strictly (``body``), token usage read from
answers (``usage``), and SSE streams: their media type, JSON answers as event streams and
back (``sse``); the models a named tenant may name (``allowed_models``)."""
