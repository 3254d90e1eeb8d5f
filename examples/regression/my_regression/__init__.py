"""A user's regression project: data and model, nothing accel-train specific."""
