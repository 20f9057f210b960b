"""The real PyTorch backend: models split into layers, data, and pipeline execution (imports torch lazily)."""
