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


@dataclass
class TrainedWeights:
    """What a job trains on its model, as the kernel that holds it counted (get_info's `trained`)."""

    kind: str  # "lora": an adapter on the shared base; "full": every weight, on the job's own copy
    parameters: int  # trainable parameters
    base_parameters: int  # the base model's
    # LoRA: trainable parameters per target, by module name (q_proj, ..., lm_head; "experts" for the adapters on a
    # mixture of experts' fused expert parameters); full fine-tuning: empty (everything is trained)
    targets: dict[str, int]
    expert_parameters: list[str]  # the fused expert parameters LoRA adapts (gate_up_proj, down_proj), each per expert
    experts: int = 0  # experts per MoE layer (0: a dense model)
    router_trained: bool | None = None  # MoE only: LoRA never targets the router; full fine-tuning trains it
