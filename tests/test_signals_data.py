"""Signals (issue 64) through the real CLI, on data generated here (tests/test_signals.py is
about OS signals):

- dataset=audio_folder: rising against falling chirps, which one spectrogram frame cannot tell
  apart (both sweep the same band), reach >= 90 % validation accuracy with the default model
  (spec_cnn on log-mel features made on the device): the features keep time order. A
  `_background_noise_` folder is not a class.
- dataset=signal_arrays on an HDF5 file in RadioML 2018's layout (X (N, L, 2) channels last, Y
  one-hot, Z the SNR): BPSK, QPSK and noise at 0, 10 and 20 dB train with the default model
  (resnet1d) and iq_power_norm, and log val/acc_snr/<dB> and accuracy_vs_snr.png.
- torchcodec's windowed decode gives the samples of the same span of a whole-file decode (wav
  resampled, flac).
- Refusals by name: a pickle (naming accel-data convert), a window longer than every recording,
  NaN samples, an empty and a corrupt sound file.

The generated radio set's SNR convention: Es/N0 per complex sample (the noise's total power,
I and Q together, is the signal's mean power / 10^(SNR/10)).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_same_weights, check_ok, read_jsonl

sf = pytest.importorskip("soundfile")
pytest.importorskip("torchcodec")
h5py = pytest.importorskip("h5py")

RATE = 8000


def chirp(rising: bool, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """A linear sweep over 400-2800 Hz (jittered), up or down, with a little noise."""
    t = np.arange(int(seconds * RATE)) / RATE
    lo, hi = 400 + rng.uniform(-100, 100), 2800 + rng.uniform(-200, 200)
    f0, f1 = (lo, hi) if rising else (hi, lo)
    phase = 2 * np.pi * (f0 * t + (f1 - f0) * t**2 / (2 * seconds))
    x = rng.uniform(0.3, 0.8) * np.sin(phase) + 0.02 * rng.standard_normal(t.size)
    return x.astype(np.float32)


@pytest.fixture(scope="module")
def chirps(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chirps")
    rng = np.random.default_rng(0)
    for name, rising in (("rising", True), ("falling", False)):
        (root / name).mkdir()
        for i in range(24):
            sf.write(root / name / f"{i:02d}.wav", chirp(rising, 1.0, rng), RATE)
    (root / "_background_noise_").mkdir()  # not a class
    sf.write(root / "_background_noise_" / "noise.wav", rng.standard_normal(RATE) * 0.1, RATE)
    return root


def audio_args(root: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "dataset=audio_folder",
        f"dataset.root={root}",
        f"dataset.sample_rate={RATE}",
        "dataset.clip_seconds=0.5",
        "dataset.eval_clips=2",
        "dataset.val_fraction=0.25",
        "dataset.features.n_fft=256",
        "dataset.features.hop_length=64",
        "dataset.features.n_mels=32",
        "model.width=8",
        "optimizer=adamw",
        "optimizer.lr=0.001",  # (0.003: BatchNorm's running statistics lag, val/acc flips)
        "loader.batch_size=8",
        "trainer.max_epochs=8",
        "trainer.deterministic=true",
        "trainer.progress=none",
        "logger=none",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


STEPS_PER_EPOCH = 5  # 36 training recordings (12 held out) in batches of 8, the last one short


@pytest.fixture(scope="module")
def chirp_runs(chirps, tmp_path_factory, run_cli_in) -> dict:
    """The reference run (no loader workers), and the same with 2 workers stopped mid-epoch
    (in the second epoch), then resumed."""
    cwd = tmp_path_factory.mktemp("chirp-runs")
    dirs = {"ordered": cwd / "ordered", "resumed": cwd / "resumed"}
    mask = "dataset.features.time_mask=8"
    proc = run_cli_in(audio_args(chirps, dirs["ordered"], mask), cwd)
    check_ok(proc)
    common = audio_args(chirps, dirs["resumed"], mask, "loader.num_workers=2", "resume=auto")
    check_ok(run_cli_in([*common, f"trainer.max_steps={STEPS_PER_EPOCH + 2}"], cwd))
    check_ok(run_cli_in(common, cwd))
    return {**dirs, "output": proc.stdout + proc.stderr}


def test_chirps_train_to_90_percent_with_the_default_model(chirp_runs):
    run_dir = chirp_runs["ordered"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_val_acc"] >= 0.9, summary
    cfg = (run_dir / ".hydra" / "config.yaml").read_text()
    assert "accel_train.models.signals.spec_cnn" in cfg  # no model named: the spectrogram CNN
    assert "2 classes (falling, rising)" in chirp_runs["output"]  # _background_noise_: no class
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "val/clip_acc" in r]
    assert rows, "evaluation scores 2 windows per recording, averaged"


def test_a_resume_with_workers_gives_the_uninterrupted_weights(chirp_runs):
    """The windows and SpecAugment's masks are drawn from (seed, epoch, index): the batches do
    not depend on the number of loader workers or on a mid-epoch resume."""
    assert_same_weights(chirp_runs["ordered"] / "checkpoints" / "last.pt",
                        chirp_runs["resumed"] / "checkpoints" / "last.pt")  # fmt: skip


# ---- arrays: an HDF5 file in RadioML 2018's layout ------------------------------------------

CLASSES = ("bpsk", "qpsk", "noise")
SNRS = (0, 10, 20)


def burst(kind: str, snr_db: float, length: int, rng: np.random.Generator) -> np.ndarray:
    """(length, 2) I/Q, 4 samples a symbol; noise at Es/N0 = snr_db (see the module docstring)."""
    symbols = length // 4
    if kind == "bpsk":
        s = rng.choice([-1.0, 1.0], symbols) + 0j
    elif kind == "qpsk":
        s = (rng.choice([-1.0, 1.0], symbols) + 1j * rng.choice([-1.0, 1.0], symbols)) / 2**0.5
    else:
        s = np.zeros(symbols, complex)
    x = np.repeat(s, 4)
    sigma = (10 ** (-snr_db / 10) / 2) ** 0.5  # per real channel
    x = x + sigma * (rng.standard_normal(length) + 1j * rng.standard_normal(length))
    return np.stack([x.real, x.imag], 1).astype(np.float32)


def write_radio(path: Path, per_cell: int = 40, length: int = 128, nan_row: int | None = None):
    rng = np.random.default_rng(1)
    xs, ys, zs = [], [], []
    for c, kind in enumerate(CLASSES):
        for snr in SNRS:
            for _ in range(per_cell):
                xs.append(burst(kind, snr, length, rng))
                ys.append(np.eye(len(CLASSES), dtype=np.int64)[c])
                zs.append([snr])
    x = np.stack(xs)
    if nan_row is not None:
        x[nan_row, 3, 1] = np.nan
    if path.suffix == ".npz":
        np.savez(path, X=x, Y=np.stack(ys), Z=np.array(zs))
        return path
    with h5py.File(path, "w") as f:  # RadioML 2018's keys and shapes
        f["X"], f["Y"], f["Z"] = x, np.stack(ys), np.array(zs)
    return path


def test_radio_hdf5_trains_and_logs_accuracy_per_snr(run_cli, tmp_path):
    data = write_radio(tmp_path / "radio.hdf5")
    run_dir = tmp_path / "run"
    proc = run_cli([
        "dataset=signal_arrays", f"dataset.path={data}",
        f"dataset.class_names=[{','.join(CLASSES)}]",
        "dataset.features.kind=iq_power_norm", "dataset.val_fraction=0.25",
        "model.width=8", "optimizer=adamw", "optimizer.lr=0.003", "loader.batch_size=32",
        "trainer.max_epochs=4", "trainer.progress=none", "logger=none",
        "trainer.plot_curves=true", f"hydra.run.dir={run_dir}",
    ])  # fmt: skip
    check_ok(proc)
    assert "stratified by class and SNR" in proc.stdout + proc.stderr
    last = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "val/acc" in r][-1]
    per_snr = {s: last[f"val/acc_snr/{s}"] for s in SNRS}
    assert per_snr[20] >= 0.9, per_snr
    assert per_snr[20] >= per_snr[0] - 0.05, per_snr
    assert (run_dir / "accuracy_vs_snr.png").stat().st_size > 0
    assert "accel_train.models.signals.resnet1d" in (run_dir / ".hydra/config.yaml").read_text()


# ---- the windowed decode ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_a_window_has_the_samples_of_the_same_span_of_a_whole_decode(tmp_path, fmt):
    from torchcodec.decoders import AudioDecoder

    from accel_train.data.signals.audio import decode_window

    rng = np.random.default_rng(2)
    path = tmp_path / f"tone.{fmt}"
    t = np.arange(44100 * 2) / 44100
    sf.write(path, (0.5 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(t.size)), 44100)
    whole = AudioDecoder(str(path), sample_rate=16000, num_channels=1).get_all_samples().data
    for start in (0.0, 0.37, 1.21):
        window = decode_window(str(path), start, 0.5, 16000, 1)
        first = round(start * 16000)
        assert window.shape == (1, 8000)
        # Away from the window's edges (the resampler's filter reaches past them), equal.
        inner = slice(64, 8000 - 64)
        np.testing.assert_allclose(
            window[:, inner].numpy(), whole[:, first : first + 8000][:, inner].numpy(), atol=2e-3
        )


# ---- the features -----------------------------------------------------------------------------


@pytest.mark.parametrize(("scale", "norm"), [("htk", None), ("slaney", "slaney")])
def test_log_mel_matches_librosa_in_db(scale, norm):
    """The same mel scale, norm and padding (centred frames, reflected edges) as librosa's, in
    dB with an absolute tolerance (a relative one fails in near-silent bins)."""
    import torch

    from accel_train.data.signals.features import build_features

    librosa = pytest.importorskip("librosa")
    sr, rng = 16000, np.random.default_rng(0)
    t = np.arange(sr) / sr
    y = 0.5 * np.sin(2 * np.pi * 440 * t) * np.linspace(0, 1, sr) + 0.01 * rng.standard_normal(sr)
    y = y.astype(np.float32)
    mel = dict(n_fft=512, hop_length=160, n_mels=40, norm=norm)
    features = build_features({"kind": "log_mel", "mel_scale": scale, **mel}, sr, "audio")
    ours = features(torch.from_numpy(y)[None, None], False, None)[0, 0].numpy()
    power = librosa.feature.melspectrogram(y=y, sr=sr, htk=scale == "htk", center=True,
                                           pad_mode="reflect", power=2.0, **mel)  # fmt: skip
    theirs = librosa.power_to_db(power, ref=1.0, amin=1e-10, top_db=80.0)
    np.testing.assert_allclose(ours, theirs, atol=0.01)


def test_the_db_cut_is_per_example():
    """A quiet example's log-mel does not depend on a loud batch mate (torchaudio's 3-D batch
    would share one top_db cut)."""
    import torch

    from accel_train.data.signals.features import build_features

    features = build_features({"kind": "log_mel"}, 16000, "audio")
    gen = torch.Generator().manual_seed(0)
    quiet = 1e-3 * torch.randn(1, 1, 16000, generator=gen)
    loud = torch.randn(1, 1, 16000, generator=gen)
    alone = features(quiet, False, None)
    together = features(torch.cat([quiet, loud]), False, None)[:1]
    torch.testing.assert_close(alone, together)


# ---- refusals ---------------------------------------------------------------------------------


def refused(proc, *words: str) -> str:
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    assert "Traceback" not in text, text
    for word in words:
        assert word in text, text
    return text


def test_refusals_by_name(run_cli, tmp_path):
    common = ["trainer.progress=none", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"]
    pickle = tmp_path / "RML2016.10a_dict.pkl"
    pickle.write_bytes(b"\x80\x04N.")
    refused(run_cli(["dataset=signal_arrays", f"dataset.path={pickle}", *common]),
            "accel-data convert", str(pickle))  # fmt: skip
    arrays = tmp_path / "arrays"  # a folder of .npy files (memory-mapped), complex I/Q
    arrays.mkdir()
    np.save(arrays / "X.npy", np.ones((6, 64), np.complex64))
    np.save(arrays / "Y.npy", np.arange(6) % 2)
    refused(run_cli(["dataset=signal_arrays", f"dataset.path={arrays}", "dataset.window=65",
                     *common]), "dataset.window=65", "64 samples")  # fmt: skip
    nan = write_radio(tmp_path / "nan.npz", per_cell=2, length=64, nan_row=5)
    refused(run_cli(["dataset=signal_arrays", f"dataset.path={nan}", *common]),
            "NaN", "row 5")  # fmt: skip
    sounds = tmp_path / "sounds"
    for name in ("a", "b"):
        (sounds / name).mkdir(parents=True)
        sf.write(sounds / name / "ok.wav", np.zeros(800, np.float32) + 0.1, RATE)
    (sounds / "a" / "empty.wav").write_bytes(b"")
    (sounds / "b" / "corrupt.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk" * 4)
    listed = sounds / "list.csv"  # (the class folders are read by the chirps' runs)
    listed.write_text("path,label\na/ok.wav,a\na/empty.wav,a\nb/ok.wav,b\nb/corrupt.wav,b\n")
    refused(run_cli(["dataset=audio_folder", f"dataset.root={sounds}",
                     f"dataset.list_file={listed}", *common]),
            "empty.wav", "corrupt.wav", "2 file(s) cannot be read")  # fmt: skip
    assert not (tmp_path / "run" / "checkpoints").exists()
