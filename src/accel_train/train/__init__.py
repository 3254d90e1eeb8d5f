"""The training side: config -> objects (build), the loop (loop), scoring and accel-eval
(evaluate). Runs in one process or as one torchrun rank; knows nothing of launchers."""
