"""Low-rank adapters (LoRA) for fine-tuning with the base weights frozen."""
