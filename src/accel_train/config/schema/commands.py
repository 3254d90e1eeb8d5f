"""The other commands' roots: accel-eval, accel-export, accel-sample, accel-tokenize and
accel-shard (each stored as `<command>_schema` by catalogue.register_configs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from accel_train.config.schema.trainer import HarnessConfig


@dataclass
class EvalConfig:
    ckpt_path: str = MISSING
    model_path: str | None = None
    split: str | None = None
    data_path: str | None = None
    out_path: str | None = None
    data_dir: str | None = None
    batch_size: int = 0
    device: str = "auto"
    harness: HarnessConfig = field(default_factory=HarnessConfig)


@dataclass
class ExportConfig:
    ckpt_path: str = MISSING
    format: str = "onnx"
    quantize: str = "none"
    out_path: str | None = None
    data_dir: str | None = None
    batch_size: int = 0
    verify_samples: int = 0
    calib_batches: int = 8
    min_agreement: float = 0.999
    overwrite: bool = False


@dataclass
class SampleConfig:
    ckpt_path: str = MISSING
    prompt: str = ""
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1
    num_samples: int = 1
    data_dir: str | None = None
    device: str = "auto"
    chat: bool = False
    system: str | None = None


@dataclass
class TokenizeConfig:
    input: str = MISSING
    out: str = MISSING
    tokenizer: str = "char"
    vocab_size: int = 8192
    val_fraction: float = 0.1
    overwrite: bool = False


@dataclass
class ConvertConfig:
    input: str = MISSING
    out: str = MISSING
    overwrite: bool = False


@dataclass
class ShardConfig:
    dataset: Any = MISSING
    task: Any = None  # what dataset=tokens picks for training (its defaults list): unused here
    out: str = MISSING
    chunk_bytes: str = "64MB"
    num_workers: int = 1
    overwrite: bool = False
    max_side: int = 0  # image folders: re-encode images whose longer side is above it (0: never)
    min_side: int = 0  # video folders: re-encode videos whose shorter side is above it (0: never)
    jpeg_quality: int = 90  # the JPEG quality of those re-encoded images
    fps: float = 0.0  # video folders: keep at most this frame rate (0: every frame)
    crf: int = 23  # video folders: libx264's quality of the re-encoded videos
    gop: int | None = None  # video folders: most frames between key frames (None: 32 if re-encoded)
