"""Built-in models for signals (issue 64): `model=resnet1d` on raw windows (sensor channels, I/Q
as 2 channels) and `model=spec_cnn` on spectrograms (dataset=audio_folder's log-mel features).

resnet1d: a 1-D ResNet (He et al.'s basic blocks with 1-D convolutions, as in O'Shea et al.'s
RadioML 2018 ResNet and tsai's ResNet): a stem, four stages that halve the length and double
the width, global average pooling, a linear head. spec_cnn: PANNs' CNN shape, smaller: a
BatchNorm over the input's bands first (the dB values' scale), conv-BN-ReLU blocks each pooling
2x2, then the mean over frequency and max + mean over time.

Both declare their head (`head_modules`, replaced when weights come from a run with other
classes) and their blocks (`block_names`, what FSDP wraps and activation checkpointing cuts)."""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock1d(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv1d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm1d(cout)
        self.conv2 = nn.Conv1d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm1d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.skip = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv1d(cin, cout, 1, stride=stride, bias=False),
                                      nn.BatchNorm1d(cout))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + self.skip(x))


class ResNet1d(nn.Module):
    head_modules = ("head",)
    block_names = ("stages.0", "stages.1", "stages.2", "stages.3")
    input_hint = "model=resnet1d takes windows (batch, channels, samples): dataset=signal_arrays."

    def __init__(self, in_channels: int, num_classes: int, width: int = 32, depth: int = 1,
                 dropout: float = 0.0):  # fmt: skip
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv1d(in_channels, width, 7, stride=1, padding=3, bias=False),
            nn.BatchNorm1d(width),
            nn.ReLU(inplace=True),
        )
        stages, cin = [], width
        for k in range(4):
            cout = width * 2**k
            blocks = [BasicBlock1d(cin, cout, 2 if k else 1)]
            blocks += [BasicBlock1d(cout, cout, 1) for _ in range(depth - 1)]
            stages.append(nn.Sequential(*blocks))
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x)).mean(2)
        return self.head(self.dropout(x))


class SpecCNN(nn.Module):
    head_modules = ("head",)
    block_names = ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    input_hint = (
        "model=spec_cnn takes spectrograms (batch, channels, bands, frames): dataset="
        "audio_folder with dataset.features.kind=log_mel."
    )

    def __init__(self, in_channels: int, num_classes: int, width: int = 32, dropout: float = 0.2):
        super().__init__()
        self.bn0 = nn.BatchNorm2d(in_channels)

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
                nn.AvgPool2d(2, ceil_mode=True),
            )

        widths = [width, 2 * width, 4 * width, 4 * width]
        self.blocks = nn.Sequential(
            *(block(a, b) for a, b in zip([in_channels, *widths[:-1]], widths, strict=True))
        )
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.bn0(x)).mean(2)  # (B, C, frames): the bands averaged
        x = x.amax(2) + x.mean(2)  # PANNs' time pooling: max + mean
        return self.head(self.dropout(x))


def resnet1d(*, in_channels: int, num_classes: int, width: int = 32, depth: int = 1,
             dropout: float = 0.0) -> nn.Module:  # fmt: skip
    return ResNet1d(in_channels, num_classes, width, depth, dropout)


def spec_cnn(*, in_channels: int, num_classes: int, width: int = 32, dropout: float = 0.2):
    return SpecCNN(in_channels, num_classes, width, dropout)
