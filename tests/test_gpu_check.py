"""scripts/gpu_check.sh where there is no GPU (issue 22, section 6): its syntax, and that it
says so and exits at once. Its GPU path runs on a GPU machine (BENCHMARKS.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def test_gpu_check_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(SCRIPT)], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script would run")
def test_gpu_check_without_a_gpu_says_so_and_exits(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device here" in proc.stdout
    assert not (tmp_path / "out").exists()  # nothing run, nothing written
    proc = subprocess.run(
        ["bash", str(SCRIPT)], env={**env, "REQUIRE_GPU": "1"}, capture_output=True, text=True
    )
    assert proc.returncode == 3
