"""Models as layer stacks: Hugging Face configs and weights, the layers, LoRA adapters, compiled blocks."""
