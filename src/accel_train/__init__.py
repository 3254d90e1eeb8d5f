"""accel-train: a Hydra-configured PyTorch training launcher."""

__version__ = "0.1.0"
