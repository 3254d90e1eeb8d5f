"""`accel-data convert`: a RadioML 2016 pickle (``RML2016.10a_dict.pkl``, ``2016.10b``) -> an
HDF5 file that ``dataset=signal_arrays`` reads, so that training never unpickles.

RadioML 2016 ships as a Python 2 pickle of ``{(modulation, snr): float32 (n, 2, 128)}``. A
pickle runs code when it is read, so it is read here by a restricted unpickler: ``find_class``
gives only numpy's array reconstructors (``numpy.core.multiarray._reconstruct`` and its numpy 2
name, ``numpy.ndarray``, ``numpy.dtype``) and ``_codecs.encode`` (how Python 3 writes bytes in a
protocol-2 pickle); anything else in the file (a function, a class, an object) refuses the file
before it is called. ``encoding="latin1"`` reads Python 2's byte strings as numpy expects. What
comes out must be that dict of numeric arrays.

The output is a folder (nothing-lost rules of written.py: a new or empty folder, or with
``overwrite=true`` one this command wrote, replacing only its own unchanged files) holding
``radioml.h5`` with ``X`` (N, 2, L) float32 channels first, ``Y`` the class index (N,), ``Z``
the SNR in dB (N, 1), in (modulation, SNR) order; and ``classes.txt``, the modulations in
``Y``'s order (sorted), for ``dataset.class_names``.
"""

from __future__ import annotations

import io
import logging
import pickle
import shutil
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from accel_train.commands.outputs import partial_path, remove_leftovers, resolved
from accel_train.errors import UserError
from accel_train.written import check_out_folder, install

log = logging.getLogger(__name__)

COMMAND = "accel-data convert"  # who the folder's manifest says wrote it
OUTPUT = "radioml.h5"  # the arrays, in the folder `out`
ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),  # numpy 1's array reconstructor
    ("numpy._core.multiarray", "_reconstruct"),  # numpy 2's
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),  # bytes in a protocol-2 pickle written by Python 3
}


class Refused(Exception):
    """The pickle names something other than numpy's array reconstructors."""


class ArraysOnly(pickle.Unpickler):
    """An unpickler that resolves only the names of ALLOWED."""

    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED:
            raise Refused(f"{module}.{name}")
        return super().find_class(module, name)


def load_arrays(path: Path) -> dict:
    """The pickle's dict of arrays, read by ArraysOnly, or a UserError (one paragraph)."""
    try:
        data = ArraysOnly(io.BytesIO(path.read_bytes()), encoding="latin1").load()
    except Refused as err:
        raise UserError(
            f"input={path} holds {err} besides numpy arrays: unpickling it would import and "
            "may call it, which runs code from the file. accel-data convert reads only "
            "pickles of numpy arrays (RadioML 2016's dict {(modulation, snr): array}); nothing "
            "was written. If you trust the file, save its arrays yourself as .npy, .npz or "
            "HDF5 and point dataset.path at them."
        ) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
        raise UserError(
            f"input={path} is not a readable pickle ({' '.join(str(err).split())[:160]}). "
            "accel-data convert reads RadioML 2016's .pkl files."
        ) from None
    _check_layout(path, data)
    return data


def _check_layout(path: Path, data) -> None:
    why = None
    if not isinstance(data, dict) or not data:
        why = f"a {type(data).__name__}, not a dict of arrays"
    else:
        for key, value in data.items():
            ok_key = isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], int)
            ok_value = isinstance(value, np.ndarray) and value.ndim == 3 and value.shape[1] == 2
            if not ok_key or not ok_value or not np.issubdtype(value.dtype, np.number):
                why = f"the entry {key!r} is not (modulation, snr) -> a numeric (n, 2, length)"
                break
        lengths = {v.shape[2] for v in data.values()} if why is None else set()
        if len(lengths) > 1:
            why = f"the arrays have different lengths ({sorted(lengths)})"
    if why:
        raise UserError(
            f"input={path}: {why}. accel-data convert reads RadioML 2016's layout, a dict "
            "{(modulation, snr_db): float32 (n, 2, length)}; nothing was written."
        )


def convert(cfg: DictConfig) -> Path:
    for key in ("input", "out"):
        if OmegaConf.is_missing(cfg, key):
            raise UserError(
                f"`{key}` is required: `accel-data convert input=<RML2016 .pkl> out=<folder>`."
            )
    source, out = Path(cfg.input).expanduser(), resolved(Path(cfg.out))
    if not source.is_file():
        raise UserError(f"input={cfg.input}: no such file. Give RadioML 2016's .pkl file.")
    example = str(Path(cfg.out) / "radioml2016")
    check_out_folder(out, "out", COMMAND, bool(cfg.overwrite), example, shown=str(cfg.out))
    data = load_arrays(source)
    remove_leftovers(out)
    partial = partial_path(out)
    try:
        partial.mkdir(parents=True)
    except OSError as err:
        raise UserError(f"out={cfg.out}: cannot write there ({err.strerror or err}).") from None
    try:
        classes = _write(partial, data)
        install(partial, out, COMMAND, "out", OUTPUT, shown=str(cfg.out))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    print(
        f"accel-data convert: {sum(len(v) for v in data.values())} recordings, "
        f"{len(classes)} classes -> {out / OUTPUT}\n"
        f"train: accel-train dataset=signal_arrays dataset.path={out / OUTPUT} "
        f"dataset.class_names=[{','.join(classes)}]"
    )
    return out


def _write(folder: Path, data: dict) -> list[str]:
    import h5py

    classes = sorted({str(mod) for mod, _ in data})
    index = {c: i for i, c in enumerate(classes)}
    keys = sorted(data, key=lambda k: (str(k[0]), k[1]))
    x = np.concatenate([np.asarray(data[k], np.float32) for k in keys])
    y = np.concatenate([np.full(len(data[k]), index[str(k[0])], np.int64) for k in keys])
    z = np.concatenate([np.full((len(data[k]), 1), k[1], np.int64) for k in keys])
    with h5py.File(folder / OUTPUT, "w") as f:
        f["X"], f["Y"], f["Z"] = x, y, z
    (folder / "classes.txt").write_text("".join(f"{c}\n" for c in classes))
    return classes
