"""Triton Inference Server: a model repository that serves trtssd, and the server that runs it.

    tensors           the model's inputs and outputs (the names Triton LLM clients already use)
    triton_requests   one request's tensors and parameters -> prompt, SamplingParams, options
    triton_responses  the output arrays of one response
    metrics           the serving metrics (vLLM's and trtssd's names) on Triton's metrics port
    model_options     1/model.json: the engine directory and LLM options
    backend           the model itself: the always-on engine, cancellation, one FINAL each
    model             the model.py Triton loads (copied into the repository): enters trtssd's
                      Python environment, then hands every call to `backend`
    repository        `trtssd triton-repo`: writes config.pbtxt, 1/model.py and 1/model.json
    server            `trtssd triton-serve`: the nvidia-pytriton wheel's tritonserver, prepared
                      and run in the foreground

Nothing is imported here: `model` must run before anything that needs trtssd's environment.
"""
