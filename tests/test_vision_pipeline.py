"""Photos at full size (issue 38, part 2): the random resized crop against torchvision's own
box rule, the evaluation resize against torchvision's Resize + CenterCrop, DCT-scaled decoding
against a full decode, the device-side crop of dataset.decode=gpu against the CPU path, and
every bad input refused in one paragraph naming the file and the fix (the header check in
process; one CLI run for the check and one for decode=gpu without CUDA, nothing written)."""

from __future__ import annotations

import io
import math
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from accel_train.data.crops import RandomResizedCrop, eval_resize_to
from accel_train.data.images.decode import check_images, dct_scale, decode_eval, decode_train
from accel_train.data.images.folder import build_image_folder
from accel_train.errors import UserError

pytestmark = [
    pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The given NumPy array is not writable"),
]


def photo(h: int, w: int, seed: int = 0) -> np.ndarray:
    """Photo-like uint8 HWC pixels: smooth waves, a few flat shapes, mild noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack(
        [
            128 + 70 * np.sin(xx * a / w * 6 + yy * b / h * 5 + p)
            for a, b, p in rng.uniform(-1, 1, (3, 3))
        ],
        -1,
    )
    for _ in range(4):
        y0, x0 = rng.integers(0, h // 2), rng.integers(0, w // 2)
        img[y0 : y0 + h // 4, x0 : x0 + w // 4] = rng.integers(0, 256, 3)
    img += rng.normal(0, 4, img.shape)
    return img.clip(0, 255).astype(np.uint8)


def save(path: Path, pixels: np.ndarray, mode: str | None = None, **kw) -> Path:
    from PIL import Image

    im = Image.fromarray(pixels)
    (im.convert(mode) if mode else im).save(path, **kw)
    return path


class TorchDraws:
    """random.Random's two methods our box rule calls, drawn from torch's global generator in
    the order and form torchvision's get_params draws: both rules then see the same numbers."""

    def uniform(self, a: float, b: float) -> float:
        return torch.empty(1).uniform_(a, b).item()

    def randint(self, a: int, b: int) -> int:
        return int(torch.randint(a, b + 1, size=(1,)).item())


# ---- geometry (in process) ---------------------------------------------------------------


@pytest.mark.parametrize("shape", [(375, 500), (300, 1200), (1200, 300)])
def test_the_crop_box_is_torchvisions_get_params_draw_for_draw(shape):
    """The same random numbers give torchvision's box, the fallback included (the center crop at
    the nearest allowed ratio: the panoramas of this list reach it)."""
    from torchvision.transforms import RandomResizedCrop as TorchvisionRRC

    h, w = shape
    image = torch.empty(3, h, w)
    crop = RandomResizedCrop(224, (0.08, 1.0), hflip=True)
    fallbacks = 0
    for seed in range(100):
        torch.manual_seed(seed)
        want = TorchvisionRRC.get_params(image, [0.08, 1.0], [3 / 4, 4 / 3])
        torch.manual_seed(seed)
        got = crop.box(h, w, TorchDraws())
        assert got == tuple(want), seed
        fallbacks += got[0] == (h - got[2]) // 2 and got[1] == (w - got[3]) // 2
    if max(h, w) / min(h, w) >= 4:
        assert fallbacks > 0  # the fallback was exercised (and matched)


@pytest.mark.parametrize("crop_pct", [0.875, 0.9, 1.0])
@pytest.mark.parametrize("shape", [(37, 53), (60, 41), (48, 48)])
def test_eval_is_torchvision_resize_then_center_crop(tmp_path, shape, crop_pct):
    """Bit for bit, on a PNG (the same pixels whichever library decodes it)."""
    from torchvision.transforms import v2

    path = save(tmp_path / "x.png", photo(*shape))
    size = 32
    resize_to = eval_resize_to(size, crop_pct)
    assert resize_to == int(size / crop_pct)  # timm's floor
    tensor = torch.from_numpy(photo(*shape)).permute(2, 0, 1)
    want = v2.Compose([v2.Resize(resize_to, antialias=True), v2.CenterCrop(size)])(tensor)
    got = decode_eval(str(path), "x", size, resize_to)
    assert got.dtype == torch.uint8 and torch.equal(got, want)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.float() - b.float()).pow(2).mean().item()
    return 10 * math.log10(255**2 / max(mse, 1e-9))


def test_dct_scaled_decoding_is_close_to_a_full_decode(tmp_path):
    """A box at least 2x the output decodes at 1/2..1/8 scale (libjpeg's DCT scaling) and
    gives nearly the pixels of the full decode resized; training and evaluation."""
    from PIL import Image

    path = save(tmp_path / "big.jpg", photo(480, 640), quality=92)
    full = torch.from_numpy(np.asarray(Image.open(path).convert("RGB")).copy()).permute(2, 0, 1)
    crop = RandomResizedCrop(64, (0.5, 1.0), hflip=False)
    with Image.open(path) as im:
        assert dct_scale(im, 300, 64) == 4 and dct_scale(im, 127, 64) == 1
    for seed in range(4):
        got = decode_train(str(path), "x", crop, 64, random.Random(seed))
        top, left, h, w = crop.box(480, 640, random.Random(seed))
        want = crop.finish(full[:, top : top + h, left : left + w], 64, random.Random(0))
        assert psnr(got, want) > 32, seed  # 33.4-40.6 dB measured: the edges move < 1/2 px
    got = decode_eval(str(path), "x", 64, 73)  # 480 -> 73: decoded at 1/4
    from torchvision.transforms import v2

    want = v2.Compose([v2.Resize(73, antialias=True), v2.CenterCrop(64)])(full)
    assert psnr(got, want) > 32


def test_simplejpeg_and_pil_decode_the_same_pixels(tmp_path, monkeypatch):
    """JPEGs decode through simplejpeg when it is installed (data/images/decode.py's fast path): a
    sample equals PIL's path bit for bit, at full and DCT-reduced scale, 4:2:0 and 4:4:4, from
    a path and from bytes, for training and evaluation; a file it does not take (grayscale,
    CMYK, corrupt, PNG) takes PIL's path and is refused with PIL's path's message."""
    import accel_train.data.images.decode as decode

    taken = []
    fast_pixels = decode._jpeg_pixels
    monkeypatch.setattr(
        decode, "_jpeg_pixels", lambda *a, **k: taken.append(1) or fast_pixels(*a, **k)
    )

    def through_pil(fn, *args):
        monkeypatch.setattr(decode, "_SIMPLEJPEG", [None])
        try:
            return fn(*args)
        finally:
            monkeypatch.setattr(decode, "_SIMPLEJPEG", [])

    files = [
        save(tmp_path / "a.jpg", photo(480, 640), quality=92),
        save(tmp_path / "b.jpg", photo(300, 410, 1), quality=85, subsampling=0),
    ]
    crop = RandomResizedCrop(64, (0.08, 1.0), hflip=True)
    scales = set()
    for path in files:
        for seed in range(12):
            scales.add(
                decode.jpeg_scale(min(crop.box(*photo_size(path), random.Random(seed))[2:]), 64)
            )
            for source in (str(path), path.read_bytes()):
                fast = decode_train(source, "x", crop, 64, random.Random(seed))
                slow = through_pil(decode_train, source, "x", crop, 64, random.Random(seed))
                assert torch.equal(fast, slow), (path.name, seed)
        for size, resize_to in ((64, 73), (224, 256)):  # 1/4 and 1 scale
            fast = decode_eval(str(path), "x", size, resize_to)
            assert torch.equal(fast, through_pil(decode_eval, str(path), "x", size, resize_to))
    assert scales == {1, 2, 4} and len(taken) == 2 * 2 * 12 + 4

    taken.clear()
    for problem, path in bad_files(tmp_path / "bad").items():
        with pytest.raises(UserError) as fast:
            decode_train(str(path), "x", crop, 16, random.Random(0))
        with pytest.raises(UserError) as slow:
            through_pil(decode_train, str(path), "x", crop, 16, random.Random(0))
        assert problem in str(fast.value) and str(fast.value) == str(slow.value)
    assert not taken  # none of them reached simplejpeg's decode


def photo_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as im:
        return im.height, im.width


def test_training_crops_flip_and_keep_their_seed(tmp_path):
    path = save(tmp_path / "x.jpg", photo(90, 120), quality=95)
    crop = RandomResizedCrop(32, (0.08, 1.0), hflip=True)
    a = [decode_train(str(path), "x", crop, 32, random.Random(f"0/1/{i}")) for i in range(40)]
    b = [decode_train(str(path), "x", crop, 32, random.Random(f"0/1/{i}")) for i in range(40)]
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(x.shape == (3, 32, 32) and x.dtype == torch.uint8 for x in a)
    flips = [random.Random(f"0/1/{i}") for i in range(40)]
    flipped = sum(1 for r in flips if (crop.box(90, 120, r), r.random() < 0.5)[1])
    assert 5 < flipped < 35


# ---- dataset.decode=gpu's device path, run on the CPU --------------------------------------


def test_the_device_crop_gives_the_cpu_paths_pixels(tmp_path):
    """decode=gpu's items (bytes + the box drawn from the header) decoded and cropped by the
    device transform's code (here on the CPU) against the CPU path's samples."""
    for c in ("a", "b"):
        (tmp_path / "train" / c).mkdir(parents=True)
        for k in range(6):
            save(tmp_path / "train" / c / f"{k}.jpg", photo(40 + 3 * k, 62 - 4 * k, k), quality=95)
    kw = dict(root=str(tmp_path), image_size=32, eval_image_size=40, val_fraction=0.34)
    cpu, gpu = build_image_folder(**kw), build_image_folder(**kw, decode="gpu")
    for name in ("train", "val"):
        a, b = getattr(cpu, name), getattr(gpu, name)
        want = torch.stack([a.getitem(i, 3)[0] for i in range(len(a))])
        batch, labels = b.collate([b.getitem(i, 3) for i in range(len(b))])
        assert torch.equal(labels, a.labels)
        got = batch.decode_on(torch.device("cpu"))
        assert got.shape == want.shape and got.dtype == torch.uint8
        if name == "val":  # both decoders accurate: float resizes vs uint8 ones, 1 level apart
            assert (got.int() - want.int()).abs().max() <= 2
        # training samples are decoded with libjpeg's fast IDCT on the CPU, accurately here:
        # the same boxes and flips measured 29.9-40.2 dB, the CPU's crops shifted by one pixel
        # 21.2-26.7 dB, flipped 9.6-16.2 dB
        assert min(psnr(g, w) for g, w in zip(got, want, strict=True)) > 28, name


# ---- bad inputs ---------------------------------------------------------------------------


def bad_files(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    px = photo(24, 32)
    corrupt = save(folder / "corrupt.jpg", px)
    corrupt.write_bytes(corrupt.read_bytes()[:200])
    palette = save(folder / "palette.png", px, "P")
    from PIL import Image

    with Image.open(palette) as im:
        im.load()
        im.save(folder / "transparent.png", transparency=0)
    palette.unlink()
    return {
        "corrupt or unreadable": corrupt,
        "is a CMYK JPEG": save(folder / "cmyk.jpg", px, "CMYK"),
        "has an alpha channel (mode RGBA)": save(folder / "rgba.png", px, "RGBA"),
        "has an alpha channel (mode LA)": save(folder / "la.png", px, "LA"),
        "has an alpha channel (mode P with a transparent colour)": folder / "transparent.png",
        "is grayscale (mode L)": save(folder / "gray.jpg", px, "L"),
    }


FIXES = {
    "corrupt or unreadable": "Delete or replace that file",
    "is a CMYK JPEG": "-colorspace sRGB",
    "has an alpha": "-alpha remove",
    "is grayscale": "-type TrueColor",
}


def test_each_bad_file_is_one_paragraph_naming_it_and_the_fix(tmp_path):
    good = save(tmp_path / "good.jpg", photo(24, 32))
    check_images([str(good), str(save(tmp_path / "good.png", photo(24, 32)))])
    for problem, path in bad_files(tmp_path / "bad").items():
        with pytest.raises(UserError) as err:
            check_images([str(good), str(path)])
        msg = str(err.value)
        assert str(path) in msg and problem in msg and "\n" not in msg, msg
        fix = next(v for k, v in FIXES.items() if problem.startswith(k))
        assert fix in msg, msg
    with pytest.raises(UserError, match=r"good.png is a PNG, and dataset.decode=gpu decodes"):
        check_images([str(tmp_path / "good.png")], jpeg_only=True)


def test_several_bad_files_are_counted_in_one_message(tmp_path):
    paths = [str(p) for p in bad_files(tmp_path).values()]
    with pytest.raises(UserError, match=r"5 other file\(s\) cannot be read as RGB either"):
        check_images(paths)


def test_a_jpeg_cut_short_is_found_by_its_missing_end_marker(tmp_path, monkeypatch):
    """Cut inside its entropy data (the header reads fine, PIL's lazy open succeeds): refused
    by the missing EOI, every such file named at once; padding or a trailer after EOI (a phone's
    metadata, a motion photo's video: longer than the tail read) and an EXIF thumbnail's own
    EOI inside the header change nothing."""
    from PIL import Image

    import accel_train.data.images.decode as decode

    whole = save(tmp_path / "whole.jpg", photo(120, 160), quality=95).read_bytes()
    thumb = io.BytesIO()
    Image.fromarray(photo(16, 16)).save(thumb, "JPEG")
    files = {
        "cut1.jpg": whole[: len(whole) * 2 // 3],
        "cut2.jpg": whole[:-2],  # only the EOI marker missing
        "padded.jpg": whole + b"\x00" * 100,
        "trailer.jpg": whole + b"SEFH" + os.urandom(3 * decode.TAIL_BYTES),
        "thumb_cut.jpg": whole[:2] + _app1_with(thumb.getvalue()) + whole[2 : len(whole) // 2],
    }
    paths = {}
    for name, data in files.items():
        paths[name] = tmp_path / name
        paths[name].write_bytes(data)
    check_images([str(paths["padded.jpg"]), str(paths["trailer.jpg"])])
    bad = [str(paths[n]) for n in ("cut1.jpg", "cut2.jpg", "thumb_cut.jpg")]
    with pytest.raises(UserError) as err:
        check_images([str(paths["padded.jpg"]), *bad])
    msg = str(err.value)
    assert all(path in msg for path in bad) and "truncated" in msg and "\n" not in msg, msg
    assert "2 other file(s)" in msg


def _app1_with(payload: bytes) -> bytes:
    """An APP1 segment holding ``payload`` (a thumbnail JPEG, EOI included) before the frame."""
    return b"\xff\xe1" + (len(payload) + 2).to_bytes(2, "big") + payload


def test_a_large_folder_is_checked_by_processes(tmp_path, monkeypatch):
    import accel_train.data.images.decode as decode

    monkeypatch.setattr(decode, "SCAN_PROCESSES_FROM", 2)
    monkeypatch.setattr(decode, "SCAN_PROCESSES", 2)
    paths = [str(p) for p in bad_files(tmp_path).values()]
    with pytest.raises(UserError, match=r"corrupt.jpg is corrupt .* 5 other file\(s\)"):
        check_images(paths)


def test_with_the_check_off_a_bad_file_stops_its_sample(tmp_path):
    """dataset.check_images=false: the decode refuses the same file, in one paragraph."""
    path = save(tmp_path / "gray.jpg", photo(24, 32), "L")
    crop = RandomResizedCrop(16, (0.08, 1.0), hflip=True)
    with pytest.raises(UserError, match=r"x: .*gray.jpg is grayscale \(mode L\)"):
        decode_train(str(path), "x", crop, 16, random.Random(0))


# ---- the real CLI -------------------------------------------------------------------------


def tree(root: Path) -> Path:
    for c in ("a", "b"):
        (root / "train" / c).mkdir(parents=True)
        for k in range(4):
            save(root / "train" / c / f"{k}.jpg", photo(20, 24, k))
    return root


def cli(root: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "dataset=image_folder",
        f"dataset.root={root}",
        "dataset.image_size=16",
        "model=mnist_cnn",
        "trainer.max_steps=1",
        "trainer.progress=none",
        "logger=none",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


def test_cli_refuses_bad_files_and_gpu_decoding_without_cuda_writing_nothing(run_cli, tmp_path):
    """A CMYK and a transparent file in the folder: exit 2, one paragraph naming the first and
    counting the other, no run dir left. decode=gpu on this CPU machine: the same, refused
    before the data is read."""
    if torch.cuda.is_available():
        pytest.skip("decode=gpu is refused only without CUDA")
    root = tree(tmp_path / "data")
    bad = bad_files(tmp_path / "made")
    shutil.move(bad["is a CMYK JPEG"], root / "train" / "a" / "cmyk.jpg")
    shutil.move(bad["has an alpha channel (mode RGBA)"], root / "train" / "b" / "rgba.png")
    run_dir = tmp_path / "runs" / "bad"
    proc = run_cli(cli(root, run_dir))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    error = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(error) == 1 and "train/a/cmyk.jpg is a CMYK JPEG" in error[0], proc.stderr
    assert "1 other file(s)" in error[0] and "rgba.png" in error[0]
    assert not run_dir.exists() and not (tmp_path / "runs").exists()

    (root / "train" / "a" / "cmyk.jpg").unlink()
    (root / "train" / "b" / "rgba.png").unlink()
    proc = run_cli(cli(root, run_dir, "dataset.decode=gpu"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "dataset.decode=gpu decodes the JPEGs on the CUDA device" in proc.stderr
    assert "`dataset.decode=cpu`" in proc.stderr and "Traceback" not in proc.stderr
    assert not run_dir.exists()


# ---- pre-resized shards (accel-data shard max_side=N) ---------------------------------------


def test_shrink_keeps_small_images_and_shrinks_large_ones(tmp_path):
    from PIL import Image

    from accel_train.commands.shard import ReadItem

    small = save(tmp_path / "small.png", photo(30, 40))
    large = save(tmp_path / "large.jpg", photo(120, 200), quality=95)
    read = ReadItem(max_side=64, quality=90)
    assert read((0, str(small), 1))["image"] == small.read_bytes()  # no second generation
    item = read((3, str(large), 2))
    assert (item["index"], item["label"]) == (3, 2)
    with Image.open(io.BytesIO(item["image"])) as im:
        assert (im.format, im.size, im.mode) == ("JPEG", (64, 38), "RGB")


def test_shards_at_max_side_stream_with_the_image_folder_crops(run_cli, tmp_path):
    """accel-data shard max_side=32 writes shrunk JPEGs; dataset=streaming's training items of
    those bytes are the image_folder path's crop of the same bytes, seed for seed."""
    import litdata

    from accel_train.data.images.streaming import _Decoder

    root = tmp_path / "data"
    for c in ("a", "b"):
        (root / "train" / c).mkdir(parents=True)
        for k in range(3):
            save(root / "train" / c / f"{k}.jpg", photo(48, 64, k), quality=95)
    out = tmp_path / "shards"
    args = ["shard", "dataset=image_folder", f"dataset.root={root}", f"out={out}", "max_side=32"]
    proc = run_cli([*args, "dataset.val_fraction=0.34"], prog="accel-data")
    assert proc.returncode == 0, proc.stderr[-3000:]
    items = list(litdata.StreamingDataset(str(out / "train")))
    assert len(items) == 4
    crop = RandomResizedCrop(16, (0.08, 1.0), hflip=True)
    decoder = _Decoder(16, 18, "random", crop, 0, "x", "bilinear")
    from PIL import Image

    for item in items:
        with Image.open(io.BytesIO(bytes(item["image"]))) as im:
            assert im.size == (32, 24)
        image, label = decoder(item, 5)
        rng = random.Random(f"0/5/{int(item['index'])}")
        assert torch.equal(image, decode_train(bytes(item["image"]), "x", crop, 16, rng))
        assert label == int(item["label"]) and image.shape == (3, 16, 16)
