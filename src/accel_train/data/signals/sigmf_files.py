"""SigMF recordings (``.sigmf-meta`` + ``.sigmf-data``) for ``dataset=signal_arrays``.

``dataset.path`` is one ``.sigmf-meta`` file or a folder holding several (searched
recursively). The ``sigmf`` package reads them: it converts any datatype (complex ``c*`` and
real ``r*``; integer and float widths; little or big endian) to complex64 / float32 scaled to
[-1, 1) for integers, so nothing here parses a datatype. Complex samples become 2 channels I and
Q, a multi-channel capture its channels.

Labels come from the annotations: an annotation's ``core:label``, or, when it has one, its
``signal:detail`` modulation class (``mod_class`` and ``order``: ``psk4``, ``qam16``) which
takes precedence. An annotation without ``core:sample_count`` runs to the end of the capture;
annotations may overlap (each is cut on its own). Each annotation gives windows of
``dataset.window`` samples every ``dataset.stride`` (null: the window, no overlap); null window:
the shortest annotation's length. Annotations shorter than the window give none (logged).

Every file must state its sample rate (``core:sample_rate``), or ``dataset.sample_rate`` gives
it; recordings at different rates are refused, since a window of N samples would then span
different durations. Refused by name: a file without ``core:datatype``, a missing data file,
a file without labelled annotations.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from accel_train.data.signals.windows import Windows, starts
from accel_train.errors import UserError

log = logging.getLogger(__name__)

META = ".sigmf-meta"


def is_sigmf(path: Path) -> bool:
    return path.name.endswith(META) or (path.is_dir() and any(path.rglob(f"*{META}")))


class SigMFReader:
    """One recording, opened again in each process (the split pickles as a path)."""

    def __init__(self, meta: Path, complex_: bool):
        self.meta, self.complex = str(meta), complex_
        self._file, self._pid = None, None

    def file(self):
        if self._file is None or self._pid != os.getpid():
            self._file, self._pid = _open(Path(self.meta)), os.getpid()
        return self._file

    def read(self, start: int, count: int) -> np.ndarray:
        x = np.asarray(self.file().read_samples(start, count))
        x = x.reshape(count, -1)  # (count, channels)
        if self.complex:
            x = np.concatenate([x.real, x.imag], 1)  # I then Q of each channel
        return x.T.astype(np.float32)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_file": None, "_pid": None}


def _open(meta: Path):
    try:
        from sigmf import sigmffile
        from sigmf.error import SigMFError
    except ImportError as err:
        raise UserError(
            f"dataset.path={meta}: reading SigMF needs the `sigmf` package ({err}). Install "
            "the [signals] extra (`pip install sigmf`)."
        ) from None
    text = meta.read_text(encoding="utf-8", errors="replace")
    if '"core:datatype"' not in text:
        raise UserError(
            f"dataset.path: {meta} has no core:datatype in its global object, so its samples "
            "cannot be read (the type and width of each sample are unknown). Add e.g. "
            '`"core:datatype": "cf32_le"` (or ci16_le, ru8, ...) to its "global" object.'
        )
    try:
        return sigmffile.fromfile(str(meta), skip_checksum=True)
    except (SigMFError, OSError, ValueError, KeyError) as err:
        raise UserError(
            f"dataset.path: the SigMF recording {meta} cannot be read "
            f"({' '.join(str(err).split())[:200]}). Check its .sigmf-meta and that its "
            ".sigmf-data lies beside it."
        ) from None


def label_of(annotation: dict) -> str | None:
    detail = annotation.get("signal:detail")
    if isinstance(detail, dict) and detail.get("mod_class"):
        order = detail.get("order")
        return f"{detail['mod_class']}{order if order is not None else ''}"
    label = annotation.get("core:label")
    return str(label) if label not in (None, "") else None


def _rate(meta: Path, handle, sample_rate: float | None) -> float:
    rate = handle.get_global_info().get("core:sample_rate")
    if rate is None:
        if not sample_rate:
            raise UserError(
                f"dataset.path: {meta} states no core:sample_rate. Set `dataset.sample_rate="
                "<Hz>` (the rate it was captured at), or add it to the file's global object."
            )
        rate = sample_rate
    return float(rate)


def read_sigmf(
    path: Path, window: int | None, stride: int | None, sample_rate: float | None
) -> Windows:
    """Every annotation's windows."""
    metas = [path] if path.is_file() else sorted(path.rglob(f"*{META}"))
    spans, readers, rates = [], [], {}
    for meta in metas:
        handle = _open(meta)
        rates[meta] = _rate(meta, handle, sample_rate)
        end = int(handle.sample_count)
        complex_file = handle.is_complex_data
        readers.append(SigMFReader(meta, complex_file))
        channels = handle.num_channels * (2 if complex_file else 1)
        for a in handle.get_annotations():
            label = label_of(a)
            first = int(a.get("core:sample_start", 0))
            count = a.get("core:sample_count")
            last = min(end, first + int(count)) if count is not None else end
            if label is not None and last > first:
                spans.append((len(readers) - 1, first, last, label, channels))
    if not spans:
        raise UserError(
            f"dataset.path={path}: no SigMF annotation with a core:label (or a signal:detail "
            "mod_class) in its recordings: they give the classes. Annotate the labelled spans."
        )
    if len(set(rates.values())) > 1:
        shown = ", ".join(f"{m.name}: {r:g} Hz" for m, r in list(rates.items())[:4])
        raise UserError(
            f"dataset.path={path}: the recordings have different sample rates ({shown}); a "
            "window of N samples would span different durations. Resample them to one rate."
        )
    if len({s[4] for s in spans}) > 1:
        raise UserError(
            f"dataset.path={path}: the recordings have different channel counts (complex and "
            "real, or several channels): one model input needs one. Keep one kind per folder."
        )
    window = int(window) if window else min(s[2] - s[1] for s in spans)
    stride = int(stride) if stride else window
    sources, offsets, names = [], [], []
    for src, first, last, label, _ in spans:
        for s in starts(last - first, window, stride):
            sources.append(src)
            offsets.append(first + s)
            names.append(label)
    if not sources:
        longest = max(s[2] - s[1] for s in spans)
        raise UserError(
            f"dataset.window={window} is longer than every annotation of {path} (the longest "
            f"holds {longest} samples). Set `dataset.window` to at most {longest}."
        )
    short = len({(s[0], s[1], s[2]) for s in spans if s[2] - s[1] < window})
    if short:
        log.info("dataset=signal_arrays: %d annotation(s) shorter than the window give none",
                 short)  # fmt: skip
    classes = sorted(set(names))
    index = {c: i for i, c in enumerate(classes)}
    labels = torch.tensor([index[c] for c in names], dtype=torch.int64)
    return Windows(readers, np.array(sources), np.array(offsets), labels, classes,
                   spans[0][4], window)  # fmt: skip
