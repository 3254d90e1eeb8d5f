"""Signals (issue 64), second slice, through the real CLI on data generated here: SigMF
recordings (any datatype, overlapping annotations and ones that run to the end of the capture,
labels from core:label or signal:detail) and CSV time series (windows per recording,
standardize features), and their refusals by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import check_ok, read_jsonl

pytest.importorskip("sigmf")


def tone(freq: float, n: int, rng: np.random.Generator) -> np.ndarray:
    t = np.arange(n)
    return np.exp(2j * np.pi * freq * t + 1j * rng.uniform(0, 6.3)) + 0.05 * (
        rng.standard_normal(n) + 1j * rng.standard_normal(n)
    )


def write_sigmf(stem: Path, samples: np.ndarray, datatype: str | None, annotations: list,
                rate: float | None = 1e6) -> Path:  # fmt: skip
    """samples complex (or real) in [-1, 1): stored as `datatype` (e.g. ci16_be, rf32_le)."""
    kind, rest = datatype[:2] if datatype else "cf", datatype[2:] if datatype else "32_le"
    width, endian = rest.split("_") if "_" in rest else (rest, "le")
    base = {"f": "f", "i": "i", "u": "u"}[kind[1]] + str(int(width) // 8)
    dtype = np.dtype(("<" if endian == "le" else ">") + base)
    x = samples if kind[0] == "c" else samples.real
    scale = 2 ** (int(width) - 1) * 0.9 if kind[1] == "i" else 1.0
    parts = np.stack([x.real, x.imag], 1).reshape(-1) if kind[0] == "c" else x
    (parts * scale).astype(dtype).tofile(stem.with_suffix(".sigmf-data"))
    glob = {"core:version": "1.0.0"}
    if datatype:
        glob["core:datatype"] = datatype
    if rate:
        glob["core:sample_rate"] = rate
    meta = {"global": glob, "captures": [{"core:sample_start": 0}], "annotations": annotations}
    path = stem.with_suffix(".sigmf-meta")
    path.write_text(json.dumps(meta))
    return path


def args(path, run_dir, *extra, batch: int = 16, epochs: int = 3):
    return [
        "dataset=signal_arrays", f"dataset.path={path}", "model.width=8", "optimizer=adamw",
        "optimizer.lr=0.003", f"loader.batch_size={batch}", f"trainer.max_epochs={epochs}",
        "trainer.progress=none", "logger=none", f"hydra.run.dir={run_dir}", *extra,
    ]  # fmt: skip


def test_sigmf_recordings_of_any_datatype_train_on_their_annotations(run_cli, tmp_path):
    """Two classes (a low and a high tone) in files of three datatypes; the last annotation of
    each has no sample_count (it runs to the capture's end) and one overlaps another; one
    file's labels come from signal:detail."""
    rng = np.random.default_rng(0)
    root = tmp_path / "sigmf"
    root.mkdir()
    for i, datatype in enumerate(("ci16_be", "cf32_le", "ci8")):
        low, high = tone(0.02, 2048, rng), tone(0.3, 2048, rng)
        x = np.concatenate([low, high]) * 0.7
        if i == 2:  # signal:detail's modulation class takes precedence
            notes = [
                {"core:sample_start": 0, "core:sample_count": 2048, "core:label": "x",
                 "signal:detail": {"mod_class": "low"}},
                {"core:sample_start": 2048, "signal:detail": {"mod_class": "high"}},
            ]  # fmt: skip
        else:
            notes = [{"core:sample_start": 0, "core:sample_count": 2048, "core:label": "low"},
                     {"core:sample_start": 1024, "core:sample_count": 512, "core:label": "low"},
                     {"core:sample_start": 2048, "core:label": "high"}]  # fmt: skip
        write_sigmf(root / f"rec{i}", x, datatype, notes)
    run_dir = tmp_path / "run"
    proc = run_cli(args(root, run_dir, "dataset.window=128", "dataset.stride=64",
                        "dataset.val_fraction=0.25",
                        "dataset.features.kind=iq_power_norm"))  # fmt: skip
    check_ok(proc)
    text = proc.stdout + proc.stderr
    # 31 windows per 2048 samples at stride 64, per class and file, plus 7 in the overlap x2.
    assert "200 windows of 2 x 128 samples" in text and "2 classes (high, low)" in text, text
    last = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "val/acc" in r][-1]
    assert last["val/acc"] >= 0.9, last


def test_sigmf_refusals_by_name(run_cli, tmp_path):
    common = ["trainer.progress=none", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"]
    notes = [{"core:sample_start": 0, "core:label": "a"}]
    x = tone(0.1, 256, np.random.default_rng(1)) * 0.5
    untyped = write_sigmf(tmp_path / "untyped", x, None, notes)
    refused(run_cli(["dataset=signal_arrays", f"dataset.path={untyped}", *common]),
            str(untyped), "core:datatype")  # fmt: skip
    rateless = write_sigmf(tmp_path / "rateless", x, "cf32_le", notes, rate=None)
    refused(run_cli(["dataset=signal_arrays", f"dataset.path={rateless}", *common]),
            str(rateless), "dataset.sample_rate")  # fmt: skip


def refused(proc, *words: str) -> str:
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    assert "Traceback" not in text, text
    for word in words:
        assert word in text, text
    return text


def write_sensors(path: Path, nan_at: int | None = None) -> Path:
    """Two recordings ("walk": a 1 Hz swing; "rest": a constant with noise) of 3 channels at
    50 Hz, on different scales per channel, in one CSV with a recording column."""
    rng = np.random.default_rng(2)
    rows = ["subject,ax,ay,az,activity"]
    for rec in range(6):
        act = "walk" if rec % 2 else "rest"
        t = np.arange(200) / 50
        swing = np.sin(2 * np.pi * t + rng.uniform(0, 6.3)) if act == "walk" else 0 * t
        for k in range(200):
            ax, ay, az = 100 * swing[k], 0.01 * swing[k], 9.8 + rng.normal(0, 0.05)
            rows.append(f"s{rec},{ax + rng.normal(0, 5):.4f},{ay:.5f},{az:.4f},{act}")
    if nan_at is not None:
        parts = rows[nan_at + 1].split(",")
        rows[nan_at + 1] = ",".join([parts[0], "", *parts[2:]])
    path.write_text("\n".join(rows) + "\n")
    return path


def test_csv_series_train_in_windows_per_recording_standardized(run_cli, tmp_path):
    data = write_sensors(tmp_path / "har.csv")
    run_dir = tmp_path / "run"
    proc = run_cli(args(data, run_dir, "dataset.window=64", "dataset.stride=32",
                        "dataset.recording=subject", "dataset.label_column=activity",
                        "dataset.val_fraction=0.25", "dataset.features.kind=standardize",
                        batch=4, epochs=6))  # fmt: skip
    check_ok(proc)
    text = proc.stdout + proc.stderr
    # 200 rows per recording: starts 0, 32, ..., 128 (5 windows), never across two recordings.
    assert "30 windows of 3 x 64 samples" in text and "2 classes (rest, walk)" in text, text
    last = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "val/acc" in r][-1]
    assert last["val/acc"] >= 0.9, last


def test_a_window_with_nan_is_refused_naming_file_and_row(run_cli, tmp_path):
    data = write_sensors(tmp_path / "har.csv", nan_at=310)
    proc = run_cli(args(data, tmp_path / "run", "dataset.window=64",
                        "dataset.recording=subject", "dataset.label_column=activity"))  # fmt: skip
    refused(proc, str(data), "row 312", "NaN")


# ---- accel-data convert: RadioML 2016's pickle -> HDF5 ----------------------------------------


class Payload:
    """What a hostile pickle holds: unpickling it would call os.system."""

    def __reduce__(self):
        import os

        return (os.system, ("touch pwned",))


def test_a_radioml_2016_pickle_is_converted_and_trains(run_cli, tmp_path):
    import pickle

    rng = np.random.default_rng(3)
    data = {
        (mod, snr): np.stack([np.stack([x.real, x.imag]) for x in
                              (tone(f, 64, rng) for _ in range(24))]).astype(np.float32)
        for mod, f in (("LOW", 0.02), ("HIGH", 0.3)) for snr in (-2, 18)
    }  # fmt: skip
    pkl = tmp_path / "RML2016.10a_dict.pkl"
    pkl.write_bytes(pickle.dumps(data, protocol=2))  # RadioML 2016's protocol
    out = tmp_path / "converted"
    proc = run_cli(["convert", f"input={pkl}", f"out={out}"], prog="accel-data")
    check_ok(proc)
    assert "dataset.class_names=[HIGH,LOW]" in proc.stdout, proc.stdout
    assert (out / "classes.txt").read_text() == "HIGH\nLOW\n"
    # Nothing lost: a second run is refused, overwrite=true replaces the command's own files.
    again = run_cli(["convert", f"input={pkl}", f"out={out}"], prog="accel-data")
    refused(again, "overwrite=true")
    check_ok(run_cli(["convert", f"input={pkl}", f"out={out}", "overwrite=true"],
                     prog="accel-data"))  # fmt: skip
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    refused(run_cli(["convert", f"input={pkl}", f"out={mine}", "overwrite=true"],
                    prog="accel-data"), "notes.txt")  # fmt: skip
    assert (mine / "notes.txt").read_text() == "mine"
    run_dir = tmp_path / "run"
    train = run_cli(args(out / "radioml.h5", run_dir, "dataset.class_names=[HIGH,LOW]",
                         "dataset.val_fraction=0.25", "dataset.features.kind=iq_power_norm",
                         "trainer.plot_curves=false", epochs=2))  # fmt: skip
    check_ok(train)
    last = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "val/acc" in r][-1]
    assert "val/acc_snr/18.0" in last or "val/acc_snr/18" in last, last


def test_a_pickle_holding_anything_but_arrays_is_refused(run_cli, tmp_path):
    import pickle

    pkl = tmp_path / "evil.pkl"
    pkl.write_bytes(pickle.dumps({("BPSK", 0): Payload()}, protocol=2))
    proc = run_cli(["convert", f"input={pkl}", f"out={tmp_path / 'out'}"], prog="accel-data")
    refused(proc, str(pkl), "posix.system", "nothing was written")
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "out").exists()


# ---- official audio splits --------------------------------------------------------------------


def write_sounds(root: Path, rels: list[str]) -> Path:
    sf = pytest.importorskip("soundfile")
    rng = np.random.default_rng(4)
    for rel in rels:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        sf.write(root / rel, (0.3 * rng.standard_normal(1600)).astype(np.float32), 8000)
    return root


def audio_split_line(run_cli, root: Path, run_dir: Path, *extra: str) -> str:
    """The build's line saying how it validates, from a run of one step."""
    proc = run_cli([
        "dataset=audio_folder", f"dataset.root={root}", "dataset.sample_rate=8000",
        "dataset.clip_seconds=0.1", "dataset.features.n_fft=128", "dataset.features.hop_length=64",
        "dataset.features.n_mels=16", "model.width=4", "loader.batch_size=4",
        "trainer.max_steps=1", "trainer.progress=none", "logger=none",
        f"hydra.run.dir={run_dir}", *extra,
    ])  # fmt: skip
    check_ok(proc)
    return next(line for line in (proc.stdout + proc.stderr).splitlines() if "validating" in line)


def test_official_audio_splits_are_kept(run_cli, tmp_path):
    pytest.importorskip("torchcodec")
    # UrbanSound8K-like fold folders of class folders: fold 2 validates, folds 1 and 3 train.
    rels = [f"fold{k}/{c}/{i}.wav" for k in (1, 2, 3) for c in ("dog", "siren") for i in range(k)]
    folds = write_sounds(tmp_path / "folds", rels)
    line = audio_split_line(run_cli, folds, tmp_path / "r1", "dataset.fold=2")
    assert "validating on 4 (fold 2 of 1, 2, 3)" in line, line
    # Speech Commands' lists: listed files validate and test, the rest trains.
    sc = write_sounds(tmp_path / "sc", [f"{c}/{i}_nohash_0.wav" for c in ("yes", "no")
                                        for i in range(4)])  # fmt: skip
    (sc / "validation_list.txt").write_text("yes/0_nohash_0.wav\nno/1_nohash_0.wav\n")
    (sc / "testing_list.txt").write_text("yes/2_nohash_0.wav\n")
    line = audio_split_line(run_cli, sc, tmp_path / "r2")
    assert "validating on 2 (validation_list.txt and testing_list.txt)" in line, line
    # A list with a fold column and a speaker column: a speaker is never on both sides.
    rows, rels = ["path,label,fold,speaker"], []
    for i in range(12):
        rel = f"clips/{i}.wav"
        rels.append(rel)
        rows.append(f"{rel},{'ab'[i % 2]},{1 + i % 3},spk{i // 2}")
    listed = write_sounds(tmp_path / "listed", rels)
    (listed / "list.csv").write_text("\n".join(rows) + "\n")
    common = [f"dataset.list_file={listed / 'list.csv'}"]
    line = audio_split_line(run_cli, listed, tmp_path / "r3", *common, "dataset.fold=3")
    assert "validating on 4 (fold 3 of 1, 2, 3)" in line, line
    line = audio_split_line(run_cli, listed, tmp_path / "r4", *common, "dataset.group=speaker",
                            "dataset.val_fraction=0.34")  # fmt: skip
    # 6 speakers of 2 clips each: 2 speakers validate, both of their clips.
    assert "validating on 4 (speaker spk" in line and ": 2 of 6)" in line, line
