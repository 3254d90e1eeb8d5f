"""The model zoo: each builder takes the model config and the data set's shape."""

from __future__ import annotations

from omegaconf import DictConfig
from torch import nn


def mnist_cnn(mc: DictConfig, channels: int, size: int, classes: int) -> nn.Module:
    flat = 64 * ((size - 4) // 2) ** 2
    hidden = mc.hidden_dims[0] if mc.hidden_dims else 128
    return nn.Sequential(
        nn.Conv2d(channels, 32, 3),
        nn.ReLU(inplace=True),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Dropout(mc.dropout),
        nn.Flatten(),
        nn.Linear(flat, hidden),
        nn.ReLU(inplace=True),
        nn.Dropout(min(2 * mc.dropout, 0.9)),
        nn.Linear(hidden, classes),
    )


def mlp(mc: DictConfig, channels: int, size: int, classes: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = channels * size * size
    for hidden in mc.hidden_dims:
        layers += [nn.Linear(width, hidden), nn.ReLU(inplace=True), nn.Dropout(mc.dropout)]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def resnet18(mc: DictConfig, channels: int, size: int, classes: int) -> nn.Module:
    import torchvision

    model = torchvision.models.resnet18(weights=None, num_classes=classes)
    if size <= 64:
        # The ImageNet stem (7x7 stride 2 + max-pool) would shrink a 32x32 image to 8x8 at once.
        model.conv1 = nn.Conv2d(channels, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif channels != 3:
        model.conv1 = nn.Conv2d(channels, 64, 7, stride=2, padding=3, bias=False)
    return model


BUILDERS = {"mnist_cnn": mnist_cnn, "mlp": mlp, "resnet18": resnet18}


def build_model(mc: DictConfig, ds: DictConfig) -> nn.Module:
    return BUILDERS[mc.name](mc, ds.in_channels, ds.image_size, ds.num_classes)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def blocks_to_shard(model: nn.Module) -> list[nn.Module]:
    """The sub-modules FSDP wraps one by one (each becomes one all-gather)."""
    if hasattr(model, "layer1"):  # torchvision ResNet
        return [
            b for name in ("layer1", "layer2", "layer3", "layer4") for b in getattr(model, name)
        ]
    return [m for m in model.modules() if isinstance(m, nn.Conv2d | nn.Linear)]
