"""Configuration: the typed schema (one dataclass per option), the checks, and the run config
file. Imports no torch: the CLI loads it before Hydra composes, so a typo fails at once."""

from pathlib import Path

# The YAML config groups. In a source checkout: <repo>/configs.
CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs"
