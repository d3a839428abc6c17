"""OpenRL Lab: RL post-training of language models on shared accelerators, spoken through the Tinker API."""

__version__ = "0.1.0"
