"""The launch side: compose once, resolve, write the run's config.yaml, then run the training
in-process, under torchrun (multi-process, multi-node, elastic) or as a SLURM batch job; Hydra
multirun sweeps; and what happens after a run stops early (the SLURM requeue)."""
