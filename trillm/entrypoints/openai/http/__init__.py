"""The HTTP layer of the OpenAI-compatible server: the app and its gate (``app``, ``auth``), the listener, keep-alive, CORS, exchange clean-up and the error shape."""
