"""tinypipe: fine-tune LLMs larger than GPU memory by streaming layers from host DRAM through a pipeline."""

__version__ = "0.1.0"
