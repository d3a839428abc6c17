"""Sampler backends: `torch_sampler` (the default) and `vllm_sampler`. This module stays torch-free: the
orchestrator's config and the CLI read the backends' names from it."""

SAMPLERS = ("torch", "vllm")
