"""What a run writes and reads back: training checkpoints, Hugging Face models, peft adapters."""
