"""What a checkpoint format is: how a run's state is written to a path, read back (the config,
the progress and the rest) and loaded into a model (and optimizer). The checkpointer writes in
the format its strategy names (Strategy.checkpoint_format); every reader picks the format by
what is on disk (`matches`), so a checkpoint of any format opens under any strategy where the
format allows it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from torch import nn


class CheckpointFormat:
    name: ClassVar[str] = "format"
    suffix: ClassVar[str] = ""  # checkpoints/last<suffix>
    # The model and optimizer state are in the dict `read` returns (one file), or beside it.
    state_holds_weights: ClassVar[bool] = True

    def matches(self, path: Path) -> bool:
        """Whether the checkpoint at `path` is of this format."""
        raise NotImplementedError

    def complete(self, path: Path) -> Path:
        """The file whose presence (and mtime) says the checkpoint at `path` is whole."""
        return path

    def save(
        self,
        module: nn.Module,
        optimizer,
        rest: dict[str, Any],
        path: Path,
        env,
        *,
        saver=None,
        then: Callable[[], None] | None = None,
        flat_optimizer: bool = False,
    ) -> None:
        """Write `rest` (progress, RNG, config...) with the model and optimizer to `path`,
        atomically: a kill during the save leaves the previous checkpoint. `saver`
        (checkpoint.async_save): stage on the loop's thread, write in the background; `then`
        runs on rank 0 once the checkpoint is complete."""
        raise NotImplementedError

    def read(self, path: Path, key: str) -> dict[str, Any]:
        """The checkpoint's state (with the weights when `state_holds_weights`), read with the
        safe loader; a one-paragraph UserError naming `key` when it cannot be read."""
        raise NotImplementedError

    def load_model(self, module: nn.Module, path: Path, state: dict[str, Any]) -> None:
        """The weights into `module` (a RuntimeError when they do not fit it)."""
        raise NotImplementedError

    def load_training(
        self, module: nn.Module, optimizer, path: Path, state: dict[str, Any], sharded: bool
    ) -> None:
        """Weights and optimizer state into a run's module and optimizer (`sharded`: the run's
        own model is sharded: FSDP, TP)."""
        raise NotImplementedError
