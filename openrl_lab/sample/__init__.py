"""Sampler backends, each behind `base.SamplerBackend` (the interface a kernel holds one by, and the request and
result types they share; torch-free): `torch_backend` over `torch_sampler` (the default, and every kernel's
fallback) and `vllm_backend` over `vllm_sampler`. This module stays torch-free: the orchestrator's config and the
CLI read the backends' names from it."""

SAMPLERS = ("torch", "vllm")
