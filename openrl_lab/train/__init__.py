"""Training on torch: models (`models`), jobs on a shared base model (`trainer`: LoRA adapters or full
fine-tuning, AdamW), losses (`losses`, their inputs' rules in `loss_spec`), checkpoints (`checkpoint`) and their
export as PEFT or Hugging Face files (`export`). `hparams` (a job's LoRA and AdamW settings) and `loss_spec` are
torch-free: the gateway and the kernel protocol use them."""
