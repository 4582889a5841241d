"""TensorRT-LLM behind trtssd's interfaces (docs/tensorrt_llm.md).

- ``availability``: whether ``tensorrt_llm`` can be imported, and the one lazy import of it.
- ``build_commands``: checkpoint-conversion and ``trtllm-build`` command lines (TensorRT-LLM 1.2.x)
  for an engine's target and draft, written to a script and run where TensorRT-LLM is installed.
- ``executor_target``: the target's verification through the 1.2.x Executor API with
  ``ExternalDraftTokensConfig``, and the outcome sent to the draft rank.
- ``verifier``: the target loop's rounds on that executor (``LLM(verifier="trtllm")``).
- ``drafter``: a ``Drafter`` for TensorRT-LLM's PyTorch backend that asks a trtssd draft rank (a
  running one, or one it starts for itself) for its speculation.

TensorRT-LLM cannot be installed on this project's machines: whatever imports ``tensorrt_llm``
says "unverified: never run". Nothing here imports it at import time, and the logic that is
ours (request fields, outcome derivation, command lines) is plain Python, tested without it.
"""
