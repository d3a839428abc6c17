"""Sampler backends: `torch_sampler` (the default) and `vllm_sampler`, with the request and result types they
share in `base` (torch-free). This module stays torch-free: the orchestrator's config and the CLI read the
backends' names from it."""

SAMPLERS = ("torch", "vllm")
