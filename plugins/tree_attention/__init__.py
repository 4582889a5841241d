"""TensorRT plugin for trtssd's tree attention (UNVERIFIED; see README.md in this folder).

Import ``plugins.tree_attention.trt_plugin`` / ``.network`` explicitly; importing this package
imports neither tensorrt nor triton.
"""
