"""The OpenAI-compatible HTTP server behind `minivllm serve` (chapter 11).

`api_server` builds the FastAPI app and runs it under uvicorn; `protocol` holds the request
and response bodies; `serving_completion`, `serving_chat` and `serving_tokenization` turn
them into engine requests and engine outputs back into responses; `errors` gives every
failure OpenAI's `{"error": {...}}` shape. Only `minivllm serve` imports this package, so the
offline engine never needs FastAPI.
"""
