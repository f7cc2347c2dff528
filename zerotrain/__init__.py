"""zerotrain: memory-planned DeepSpeed training for large image diffusion models."""

__version__ = "0.1.0"
