"""What is being planned for: the model (ModelSpec, Hugging Face configs), the hardware graph, and profiled traces."""
