"""Multi-LoRA serving: PEFT adapters read from disk, slots of stacked weights in the layers, batched deltas."""
