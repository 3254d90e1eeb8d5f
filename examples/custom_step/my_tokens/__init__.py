"""A user's token model with its own training step."""
