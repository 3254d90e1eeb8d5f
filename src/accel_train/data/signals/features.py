"""The features of signal windows, computed on the device after the copy (``dataset.features``).

The loader hands over float windows ``(B, C, L)`` (evaluation items of several clips:
``(B, V, C, L)``, which leave here as ``B * V`` rows, as video clips do); a batch's features
cost about what one item's would on the host. The menu is per family, since what makes sense for
audio is wrong for I/Q:

- ``none``: the windows as they are (sensor channels, a model that learns its own front end);
- ``log_mel`` (audio): torchaudio's ``MelSpectrogram`` then dB, ``(B, C, n_mels, frames)``.
  The dB cut (``top_db``) is taken per example: torchaudio's ``amplitude_to_DB`` cuts a 4-D
  input at each example's own peak (over its channels and bins), while a ``(B, F, T)`` batch
  would share one cut, making an example depend on its batch mates. SpecAugment
  (``freq_mask``, ``time_mask``: the widest masks, 0 = off) masks training batches;
- ``standardize`` (sensors): ``(x - mean) / std`` per channel, the statistics measured once on
  the training split's windows (data/signals/windows.py: ``channel_stats``);
- ``iq_power_norm`` (radio I/Q, 2 channels I and Q): each example divided by the root of its
  mean complex power ``mean(I^2 + Q^2)``, as TorchSig and rfml normalise; per-channel statistics
  would scale I and Q apart and distort the constellation.

The masks are drawn from the batch's generator (seeded by seed/epoch/batch/rank in
data/transform.py), not from torch's global RNG as torchaudio's masking transforms draw them, so
a mid-epoch resume masks the same bins.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from accel_train.errors import UserError

KINDS = ("none", "log_mel", "iq_power_norm", "standardize")


@dataclass
class MelSettings:
    """``dataset.features``' log-mel keys (configs/dataset/audio_folder.yaml says each)."""

    n_fft: int = 400
    hop_length: int = 160
    n_mels: int = 64
    f_min: float = 0.0
    f_max: float | None = None
    mel_scale: str = "htk"
    norm: str | None = None
    top_db: float | None = 80.0


class SignalFeatures:
    """The device features of one data set: ``(windows, train, generator) -> model input``."""

    def __init__(self, kind: str, sample_rate: int, mel: MelSettings | None = None,
                 freq_mask: int = 0, time_mask: int = 0,
                 stats: tuple[list[float], list[float]] | None = None):  # fmt: skip
        self.stats = None if stats is None else tuple(torch.tensor(v)[:, None] for v in stats)
        self.kind, self.freq_mask, self.time_mask = kind, int(freq_mask), int(time_mask)
        self.mel: nn.Module | None = None
        self.top_db = mel.top_db if mel else None
        if kind == "log_mel":
            self.mel = _mel_transform(sample_rate, mel or MelSettings())
        self._on: torch.device | None = None

    def __call__(self, x: torch.Tensor, train: bool, gen: torch.Generator | None) -> torch.Tensor:
        if x.dim() == 4:  # evaluation views (B, V, C, L): B * V windows in a row
            x = x.flatten(0, 1)
        x = x.float()
        if self.kind == "iq_power_norm":
            power = x.square().sum(1, keepdim=True).mean(2, keepdim=True)  # mean(I^2 + Q^2)
            return x * power.clamp_min(1e-20).rsqrt()
        if self.kind == "standardize":
            mean, std = (v.to(x.device) for v in self.stats)
            return (x - mean) / std
        if self.kind != "log_mel":
            return x
        if self._on != x.device:  # the filterbank and window follow the batch to its device
            self.mel, self._on = self.mel.to(x.device), x.device
        from torchaudio.functional import amplitude_to_DB

        spec = amplitude_to_DB(self.mel(x), 10.0, 1e-10, 0.0, self.top_db)  # (B, C, F, T)
        if train and gen is not None and (self.freq_mask or self.time_mask):
            spec = _spec_augment(spec, self.freq_mask, self.time_mask, gen)
        return spec


def _mel_transform(sample_rate: int, mel: MelSettings) -> nn.Module:
    try:
        from torchaudio.transforms import MelSpectrogram
    except ImportError as err:
        raise UserError(
            f"dataset.features.kind=log_mel computes its spectrograms with torchaudio, which "
            f"cannot be imported here ({err}). Install it for your torch "
            "(`pip install torchaudio`, the build matching torch), or set "
            "`dataset.features.kind=none` to train on the waveforms."
        ) from None
    return MelSpectrogram(
        sample_rate=sample_rate, n_fft=mel.n_fft, hop_length=mel.hop_length, n_mels=mel.n_mels,
        f_min=mel.f_min, f_max=mel.f_max, mel_scale=mel.mel_scale, norm=mel.norm, power=2.0,
    )  # fmt: skip


def _spec_augment(spec: torch.Tensor, freq: int, time: int, gen: torch.Generator):
    """SpecAugment's masks, one frequency band and one time span per example (torchaudio's
    ``iid_masks``: a width drawn in [0, widest), a start in [0, size - width)), filled with the
    example's mean."""
    b, dev = spec.shape[0], spec.device
    keep = torch.ones(b, 1, spec.shape[2], spec.shape[3], dtype=torch.bool, device=dev)
    for axis, widest in ((2, freq), (3, time)):
        size = spec.shape[axis]
        if widest <= 0 or size < 2:
            continue
        width = (torch.rand(b, generator=gen, device=dev) * min(widest, size)).floor()
        start = (torch.rand(b, generator=gen, device=dev) * (size - width)).floor()
        pos = torch.arange(size, device=dev)
        masked = (pos >= start[:, None]) & (pos < (start + width)[:, None])  # (B, size)
        shape = (b, 1, size, 1) if axis == 2 else (b, 1, 1, size)
        keep &= ~masked.view(shape)
    fill = spec.mean(dim=(1, 2, 3), keepdim=True)
    return torch.where(keep, spec, fill)


def build_features(
    features: Mapping | None,
    sample_rate: int,
    family: str,
    stats: tuple[list[float], list[float]] | None = None,
) -> SignalFeatures:
    """``dataset.features`` checked: a kind of the menu, the family's own (log-mel on audio,
    I/Q normalisation on 2-channel arrays), widths that are numbers of bins."""
    f = dict(features or {})
    kind = str(f.get("kind", "none"))
    if kind not in KINDS:
        raise UserError(
            f"dataset.features.kind={kind!r} is not one of {', '.join(KINDS)}: `log_mel` for "
            "audio, `iq_power_norm` for radio I/Q, `none` for the windows as they are "
            "(docs/signals.md)."
        )
    if kind == "log_mel" and family != "audio":
        raise UserError(
            f"dataset.features.kind=log_mel is a feature of audio (dataset=audio_folder); "
            f"dataset={family} gives windows without a known sample rate for a mel scale. Use "
            "`dataset.features.kind=none` or `iq_power_norm`."
        )
    if kind == "standardize" and stats is None:
        raise UserError(
            f"dataset.features.kind=standardize is a feature of sensor windows "
            f"(dataset=signal_arrays), whose per-channel statistics it measures on the "
            f"training split; dataset={family} has none. Use `dataset.features.kind=log_mel`."
        )
    for key in ("freq_mask", "time_mask"):
        if int(f.get(key) or 0) < 0:
            raise UserError(f"dataset.features.{key}={f[key]} must be >= 0 (0: no mask).")
    mel_keys = {k: f[k] for k in MelSettings.__dataclass_fields__ if k in f}
    mel = MelSettings(**mel_keys)
    if kind == "log_mel" and (mel.n_fft < 2 or mel.hop_length < 1 or mel.n_mels < 1):
        raise UserError(
            f"dataset.features: n_fft={mel.n_fft}, hop_length={mel.hop_length} and "
            f"n_mels={mel.n_mels} must be >= 2, >= 1 and >= 1."
        )
    return SignalFeatures(kind, sample_rate, mel, int(f.get("freq_mask") or 0),
                          int(f.get("time_mask") or 0), stats)  # fmt: skip
