"""`tinyvllm serve`: an OpenAI-compatible HTTP server over one `AsyncLLM` (FastAPI + uvicorn,
one process). Needs the `serve` extra: `pip install 'tinyvllm[serve]'`.

- `protocol`: request/response bodies (OpenAI's shapes, vLLM's extra fields)
- `errors`: OpenAI's error shape and status codes
- `sampling`: request fields -> SamplingParams, logprobs -> the API's shapes
- `serving`: running a request through the engine, disconnects, server-sent events
- `completions`, `chat`, `embeddings`: the generating routes
- `metrics`: Prometheus exposition of the engine's statistics
- `app`: the FastAPI app; `cli`: the `serve` command's flags and startup
"""
