"""Issue 60 (Hardening 5), through the real CLI: trainer.max_steps without trainer.max_epochs
trains by steps."""

from __future__ import annotations

import json

from helpers import FAST, check_ok

# 256 samples, 10% held out: 230 train / 64 per batch = 4 steps per epoch (default: 3 epochs).
SHORT = [*FAST, "loader.batch_size=64", "trainer.test_after_fit=false"]


def _steps(run_dir) -> int:
    return json.loads((run_dir / "summary.json").read_text())["steps"]


def test_max_steps_alone_trains_by_steps(run_cli, tmp_path):
    """max_steps=20 alone: 20 steps (5 epochs), not the default max_epochs' 12; the batch line
    names the limit that ends the run. With max_epochs given too, the first limit reached."""
    run_dir = tmp_path / "steps"
    proc = run_cli([*SHORT, "trainer.max_steps=20", f"hydra.run.dir={run_dir}"])
    check_ok(proc)
    assert _steps(run_dir) == 20
    assert "trainer.max_steps=20 ends the run at step 20" in proc.stdout + proc.stderr
    both = tmp_path / "both"
    proc = run_cli(
        [*SHORT, "trainer.max_steps=20", "trainer.max_epochs=2", f"hydra.run.dir={both}"]
    )
    check_ok(proc)
    assert _steps(both) == 8
    assert "trainer.max_epochs=2 ends the run at step 8" in proc.stdout + proc.stderr
