"""dataset: a factory by `_target_` returning the splits."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from omegaconf import MISSING

# Keys every dataset option has that accel-train itself consumes (not passed to the factory
# unless its signature names them).
DATASET_COMMON_KEYS = ("name", "num_classes", "mean", "std", "random_shift", "random_hflip")


@dataclass
class DatasetConfig:
    _target_: str = MISSING
    name: str = "custom"
    num_classes: int | None = None
    mean: list[float] = field(default_factory=lambda: [0.5])
    std: list[float] = field(default_factory=lambda: [0.5])
    random_shift: int = 0
    random_hflip: bool = False
    val_fraction: float = 0.1
    seed: int = 0


@dataclass
class TorchvisionDatasetConfig(DatasetConfig):
    download: bool = True


@dataclass
class SyntheticDatasetConfig(DatasetConfig):
    in_channels: int = 1
    image_size: int = 28
    num_train: int = 2048
    num_test: int = 512


@dataclass
class TokensDatasetConfig(DatasetConfig):
    path: str = MISSING
    block_size: int = 256
    windows_per_epoch: int = 0
    eval_windows: int = 200
    document_separator: int | None = None


@dataclass
class SftDatasetConfig(DatasetConfig):
    path: str = MISSING
    val_path: str | None = None
    test_path: str | None = None
    tokenizer: str | None = None
    max_length: int = 1024
    pack: bool = False
    train_on: str = "completion"
    ignore_index: int = -100
    trim_padding: bool = True
    chat_template: str | None = None


@dataclass
class PreferenceDatasetConfig(DatasetConfig):
    path: str = MISSING
    val_path: str | None = None
    test_path: str | None = None
    tokenizer: str | None = None
    max_length: int = 1024
    max_prompt_length: int | None = 512
    ignore_index: int = -100
    chat_template: str | None = None


@dataclass
class PromptsDatasetConfig(DatasetConfig):
    path: str = MISSING
    val_path: str | None = None
    test_path: str | None = None
    tokenizer: str | None = None
    max_prompt_length: int | None = 512
    chat_template: str | None = None
    num_iterations: int = 1
    accumulate_grad_batches: int = 1


# The recipe switches of issue 38 (timm's spellings; data/images/sample_recipe.py,
# data/images/batch_mix.py): keys
# accel-train consumes itself, never passed to the dataset's factory.
@dataclass
class RecipeDatasetConfig:
    auto_augment: str | None = None
    random_erasing: float = 0.0
    random_erasing_mode: str = "pixel"
    random_erasing_count: int = 1
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    mixup_mode: str = "batch"


DATASET_RECIPE_KEYS = tuple(f.name for f in fields(RecipeDatasetConfig))


@dataclass
class ImageFolderDatasetConfig(RecipeDatasetConfig, DatasetConfig):
    root: str = MISSING
    train_split: str = "train"
    # Which folder is which split: data/folder_tree.py (issue 47).
    val_split: str | None = "val"
    test_split: str | None = "test"
    holdout: bool = False
    image_size: int = 64
    resize_size: int = 0
    augment: str = "cpu"
    crop_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    cache: str = "none"
    cache_dir: str | None = None
    # Photos at full size (issue 38; docs/vision.md).
    eval_image_size: int | None = None
    crop_pct: float = 0.875
    interpolation: str = "bilinear"
    decode: str = "cpu"
    check_images: bool = True


@dataclass
class VideoFolderDatasetConfig(DatasetConfig):
    # data/video/folder.py (issue 49); the defaults are configs/dataset/video_folder.yaml's.
    root: str = MISSING
    list_file: str | None = None
    val_list_file: str | None = None
    test_list_file: str | None = None
    train_split: str = "train"
    val_split: str | None = "val"
    test_split: str | None = "test"
    holdout: bool = False
    frames: int = 16
    frame_stride: int | None = None
    fps: float | None = 15
    image_size: int = 112
    resize_size: int = 128
    train_resize: list[int] | None = None
    crop_scale: list[float] | None = None
    eval_clips: int = 5
    eval_crops: int = 1
    clips_per_video: int = 1
    decode_threads: int = 1
    decode: str = "cpu"
    pad_short: bool = False
    shuffle_frames: bool = False
    metadata_cache: str | None = None


@dataclass
class VolumeFolderDatasetConfig(DatasetConfig):
    # data/volumes/folder.py (issue 63); the defaults are configs/dataset/volume_folder.yaml's.
    root: str = MISSING
    val_fraction: float = 0.2
    orientation: str = "RAS"
    spacing: list[float] | None = None
    intensity_range: list[float] | None = None
    crop_foreground: bool = True
    foreground_threshold: float | None = None
    cache: str = "memory"
    cache_dir: str | None = None
    patch_size: list[int] = field(default_factory=lambda: [96, 96, 96])
    samples_per_volume: int = 4
    pos_neg_ratio: float = 1.0
    random_flip: bool = True


@dataclass
class MaskFolderDatasetConfig(DatasetConfig):
    # data/images/masks.py (issue 63); the defaults are configs/dataset/mask_folder.yaml's.
    root: str = MISSING
    crop_size: int | None = None
    random_flip: bool = True
    classes: list[str] | None = None


@dataclass
class StreamingVideoDatasetConfig(DatasetConfig):
    # data/video/streaming.py: video shards, clips drawn as dataset=video_folder draws them.
    remote: str = MISSING
    local: str | None = None
    cache_limit: str = "20gb"
    frames: int = 16
    frame_stride: int | None = None
    fps: float | None = 15
    image_size: int = 112
    resize_size: int = 128
    train_resize: list[int] | None = None
    crop_scale: list[float] | None = None
    eval_clips: int = 5
    eval_crops: int = 1
    decode_threads: int = 1
    decode: str = "cpu"
    pad_short: bool = False
    shuffle_frames: bool = False


@dataclass
class StreamingDatasetConfig(DatasetConfig):
    remote: str = MISSING
    local: str | None = None
    cache_limit: str = "20gb"
    image_size: int = 64
    resize_size: int = 0
    augment: str = "cpu"
    crop_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    # Photos at full size (issue 38; docs/vision.md).
    eval_image_size: int | None = None
    crop_pct: float = 0.875
    interpolation: str = "bilinear"


@dataclass
class StreamingSftDatasetConfig(DatasetConfig):
    remote: str = MISSING
    tokenizer: str | None = None
    local: str | None = None
    cache_limit: str = "20gb"
    ignore_index: int = -100
    max_length: int | None = None
    pack: bool | None = None
    chat_template: str | None = None


@dataclass
class StreamingPreferenceDatasetConfig(DatasetConfig):
    remote: str = MISSING
    tokenizer: str | None = None
    local: str | None = None
    cache_limit: str = "20gb"
    ignore_index: int = -100
    max_length: int | None = None
    max_prompt_length: int | None = None
    chat_template: str | None = None


@dataclass
class StreamingTokensDatasetConfig(DatasetConfig):
    remote: str = MISSING
    local: str | None = None
    cache_limit: str = "20gb"
    block_size: int = 256
    eval_windows: int = 200


# Signals (issue 64): data/signals/. `features` is applied on the device after the copy
# (data/signals/features.py); its keys are the same for both options.
@dataclass
class SignalFeaturesConfig:
    kind: str = "none"
    n_fft: int = 400
    hop_length: int = 160
    n_mels: int = 64
    f_min: float = 0.0
    f_max: float | None = None
    mel_scale: str = "htk"
    norm: str | None = None
    top_db: float | None = 80.0
    freq_mask: int = 0
    time_mask: int = 0


@dataclass
class SignalKeysConfig:
    signal: str = "X"
    label: str = "Y"
    snr: str | None = "Z"


@dataclass
class SignalArraysDatasetConfig(DatasetConfig):
    path: str = MISSING
    keys: SignalKeysConfig = field(default_factory=SignalKeysConfig)
    class_names: list[str] | None = None
    channels_last: bool | None = None
    window: int | None = None
    stride: int | None = None
    sample_rate: float | None = None
    label_column: str = "label"
    recording: str | None = None
    columns: list[str] | None = None
    features: SignalFeaturesConfig = field(default_factory=SignalFeaturesConfig)


@dataclass
class AudioFolderDatasetConfig(DatasetConfig):
    root: str = MISSING
    list_file: str | None = None
    sample_rate: int = 16000
    channels: int = 1
    clip_seconds: float = 1.0
    pad: str = "zeros"
    eval_clips: int = 1
    fold: str | None = None
    group: str | None = None
    features: SignalFeaturesConfig = field(
        default_factory=lambda: SignalFeaturesConfig(kind="log_mel")
    )
