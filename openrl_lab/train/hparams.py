"""A training job's hyperparameters, torch-free: what a client asks for and the kernel protocol carries
(`openrl_lab/kernel/api.py`) as they are, and what the trainer runs with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoraSettings:
    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


@dataclass
class AdamSettings:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
