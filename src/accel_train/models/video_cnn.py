"""`model=video_cnn`: a tiny 3-D CNN for video clips, uint8 (N, C, T, H, W) normalised on the
device. Three Conv3d stages (3x3x3 kernels: each sees neighbouring frames, so motion is
learnable; the later stages stride in time and space), global average pooling, a linear head.
Built for the tests and smoke runs of `dataset=video_folder` (70 k parameters). No
normalisation layers: BatchNorm's running statistics, on the tests' few dozen clips, made
evaluation flip between epochs; GroupNorm slowed learning the motion.

It declares what the image models of model=timm declare: its head (`head_modules`, replaced
when weights come from a run with other classes) and its blocks (`block_names`, what FSDP wraps
and activation checkpointing cuts at)."""

from __future__ import annotations

from torch import nn


class VideoCNN(nn.Module):
    head_modules = ("head",)
    block_names = ("stages.0", "stages.1", "stages.2")

    def __init__(self, in_channels: int, num_classes: int, width: int = 16, dropout: float = 0.0):
        super().__init__()

        def stage(cin: int, cout: int, stride: tuple[int, int, int]) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv3d(cin, cout, 3, stride=stride, padding=1),
                nn.ReLU(inplace=True),
            )

        self.stages = nn.Sequential(
            stage(in_channels, width, (1, 2, 2)),
            stage(width, 2 * width, (2, 2, 2)),
            stage(2 * width, 4 * width, (2, 2, 2)),
        )
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        x = self.pool(self.stages(x)).flatten(1)
        return self.head(self.dropout(x))


def video_cnn(
    *, in_channels: int, num_classes: int, width: int = 16, dropout: float = 0.0
) -> nn.Module:
    return VideoCNN(in_channels, num_classes, width, dropout)
