"""Serving: the always-on target loop and the OpenAI-compatible HTTP server on it.

    async_llm          AsyncLLM: the target loop in its own thread; requests join and leave between rounds
    openai_requests    OpenAI request bodies -> token ids + SamplingParams (or a clear 4xx)
    openai_responses   OpenAI response bodies and SSE chunks
    metric_catalog     every metric's name, kind and buckets, and what a finished request adds
    prometheus_metrics vLLM-named (and trtssd:) Prometheus metrics of one server, from the catalog
    openai_server      the FastAPI routes
    uvicorn_runner     the server on a real socket, in the foreground or a background thread

Nothing is imported here, so AsyncLLM can be used without the HTTP stack.
"""
