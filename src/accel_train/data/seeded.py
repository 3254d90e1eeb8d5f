"""Running a library's random transform on a seed of our own choosing.

timm's augmentations draw from the process-wide generators (Python's ``random``, numpy's global
``np.random``, torch's default generator, and for device tensors the device's generator), not
from a generator they are given. For a mid-epoch resume to give the same images, every draw
must come from a seed fixed by what is drawn (seed, epoch, sample or batch, rank), not from how
far a running generator has got. :func:`seeded_rngs` seeds those generators for one call and
puts their states back afterwards, so nothing else (dropout, the model's initialisation, the
loader's own draws) sees a difference.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch


def derive_seed(*keys: int) -> int:
    """A 32-bit seed from integers (numpy's SeedSequence hash: stable across processes and
    Python versions, unlike ``hash`` of a string)."""
    return int(
        np.random.SeedSequence([int(k) & 0xFFFF_FFFF_FFFF for k in keys]).generate_state(1)[0]
    )


@contextlib.contextmanager
def seeded_rngs(seed: int, device: torch.device | str | None = None) -> Iterator[None]:
    """Python's, numpy's and torch's CPU generator (and ``device``'s, when it is not the CPU)
    seeded with ``seed`` inside the block, restored after it. Reading and setting a CUDA
    generator's state is host bookkeeping (its seed and offset): no device sync."""
    py_state, np_state, cpu_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    gen, device = None, torch.device(device) if device is not None else None
    if device is not None and device.type != "cpu":
        module = torch.get_device_module(device.type)
        index = device.index if device.index is not None else module.current_device()
        gen = module.default_generators[index]
        gen_state = gen.get_state()
    random.seed(seed)
    np.random.seed(seed)
    torch.default_generator.manual_seed(seed)
    if gen is not None:
        gen.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu_state)
        if gen is not None:
            gen.set_state(gen_state)
