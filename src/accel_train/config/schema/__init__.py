"""The typed config schema, being split into one module per group: until then every name is
re-exported from the whole of it (dataset.py)."""

from accel_train.config.schema.dataset import *  # noqa: F403
