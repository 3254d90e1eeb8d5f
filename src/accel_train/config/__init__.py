"""Configuration: the typed schema (one dataclass per option), the checks, and the run config
file. Imports no torch: the CLI loads it before Hydra composes, so a typo fails at once."""

from pathlib import Path

# The YAML config groups, shipped inside the package (package data), so a wheel or a
# non-editable `pip install .` finds them as an editable install does.
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
