"""dataset.metadata_cache (data/video/metadata_cache.py, issue 49): the videos' metadata read once
and kept between runs, outside the data folder, through the real CLI.

- The first run reads every file and writes the cache under $XDG_CACHE_HOME (the default), not
  into the data folder, which is left exactly as it was; a second run reads no file anew.
- A touched file and a replaced one are read again, the others come from the cache.
- dataset.metadata_cache=null reads every file; a cache folder inside dataset.root is refused
  in one paragraph.
- Two writers merge (neither loses its entries); a foreign file at the cache's name is neither
  used nor overwritten; a refused file (the header check's) is never stored.
- accel-report runs its variants on videos (test_report.py does the images).
"""

from __future__ import annotations

import csv
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import check_ok

pytest.importorskip("av")
pytest.importorskip("torchcodec")

from test_video import write_tree, write_video  # noqa: E402  (after the skips)

VIDEOS = 8  # 2 training videos per class, half of them held out for validation
TINY = [
    "dataset=video_folder",
    "dataset.frames=4",
    "dataset.frame_stride=1",
    "dataset.image_size=32",
    "dataset.resize_size=32",
    "dataset.eval_clips=1",
    "dataset.val_fraction=0.5",
    "dataset.random_hflip=false",
    "model=video_cnn",
    "loader.batch_size=4",
    "trainer.max_epochs=1",
    "trainer.progress=none",
    "logger=none",
]
READ = re.compile(r"read the metadata of (\d+) videos \((.*)\)")


def train(run_cli, root: Path, run_dir: Path, *extra: str, env: dict | None = None):
    args = [*TINY, f"dataset.root={root}", "trainer.max_steps=1", f"hydra.run.dir={run_dir}"]
    return run_cli([*args, *extra], env=env)


def metadata_line(proc) -> tuple[int, str]:
    """(videos, what the parenthesis says) of the run's one metadata line."""
    found = READ.findall(proc.stdout + proc.stderr)
    assert len(found) == 1, (proc.stdout + proc.stderr)[-3000:]
    return int(found[0][0]), found[0][1]


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_the_cache_is_read_instead_of_the_files_and_a_changed_file_is_read_again(run_cli, tmp_path):
    """Five runs, in three rounds (those of a round in parallel)."""
    root = write_tree(tmp_path / "data", {"train": VIDEOS // 4})
    before = snapshot(root)
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    home = tmp_path / "xdg" / "accel-train" / "video-metadata"

    def run(name: str, *extra: str):
        return train(run_cli, root, tmp_path / name, *extra, env=env)

    first = run("r1")
    check_ok(first)
    (cache,) = home.glob("*.json")
    assert metadata_line(first) == (VIDEOS, f"0 from the cache at {cache}")
    assert snapshot(root) == before  # nothing written into (or touched in) the data folder

    inside = f"dataset.metadata_cache={root / 'cache'}"
    with ThreadPoolExecutor(2) as pool:
        second, refused = pool.map(lambda extra: run(*extra), [("r2",), ("r3", inside)])
    check_ok(second)
    assert metadata_line(second) == (VIDEOS, f"{VIDEOS} from the cache at {cache}")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "is inside dataset.root" in refused.stderr, refused.stderr[-2000:]
    assert snapshot(root) == before

    touched, replaced = root / "train" / "up" / "000.mp4", root / "train" / "down" / "001.mp4"
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 10**9))
    write_video(replaced, "down", seed=1234, frames=12)  # fewer frames: the cache said 16
    with ThreadPoolExecutor(2) as pool:
        changed, off = pool.map(
            lambda extra: run(*extra),
            [("r4", "dataset.frames=13"), ("r5", "dataset.metadata_cache=null")],
        )
    # The two changed files read anew (the replaced one too short for 13 frames now), the
    # others from the cache; the good ones stored even though the run was refused.
    assert metadata_line(changed) == (VIDEOS, f"{VIDEOS - 2} from the cache at {cache}")
    assert changed.returncode == 2 and f"{replaced} (12 frames)" in changed.stderr
    stored = json.loads(cache.read_text())["videos"]
    assert set(stored) == {str(p) for p in root.rglob("*.mp4")}
    assert stored[str(replaced)][2] == 12 and stored[str(touched)][2] == 16
    check_ok(off)
    assert metadata_line(off) == (VIDEOS, "the cache is off: dataset.metadata_cache=null")
    assert [p.name for p in home.iterdir() if p.suffix == ".tmp"] == []


def test_writers_merge_and_a_foreign_file_is_left_alone(tmp_path):
    """Two runs that looked up the cache before either wrote both keep their entries; the
    header check's refusals are not stored; a file that is not a cache is not replaced."""
    import torch

    from accel_train.data.video.clips import Timing
    from accel_train.data.video.decode import video_metadata
    from accel_train.data.video.folder import VideoList, read_metadata
    from accel_train.data.video.metadata_cache import MetadataCache, cache_file
    from accel_train.errors import UserError

    root = write_tree(tmp_path / "data", {"train": 1})
    videos = sorted(str(p) for p in root.rglob("*.mp4"))
    file = cache_file(str(tmp_path / "cache"), root)
    a, b = MetadataCache(file), MetadataCache(file)
    assert a.lookup(videos[:2]) == {} and b.lookup(videos[2:]) == {}
    a.store({p: video_metadata(p) for p in videos[:2]})
    b.store({p: video_metadata(p) for p in videos[2:]})
    assert MetadataCache(file).lookup(videos) == {p: video_metadata(p) for p in videos}

    def read(paths: list[str], where: Path):
        lists = [VideoList(paths, torch.zeros(len(paths), dtype=torch.int64))]
        cache = MetadataCache(cache_file(str(where), root))
        return read_metadata(paths, Timing(4, 1, None), False, lists, cache)

    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"\x00not a video" * 50)
    with pytest.raises(UserError, match="cannot give a clip"):
        read([*videos, str(bad)], tmp_path / "cache")
    assert str(bad) not in file.read_text()

    foreign = cache_file(str(tmp_path / "other"), root)
    foreign.parent.mkdir()
    foreign.write_text('{"mine": true}')
    assert set(read(videos, tmp_path / "other")) == set(videos)
    assert foreign.read_text() == '{"mine": true}'


def test_accel_report_compares_switches_on_videos(run_cli, tmp_path):
    """channels_last (channels_last_3d for clips) and amp beside the baseline, one round each:
    every run trains on clips, and the report says a sample is a clip (its input shape)."""
    root = write_tree(tmp_path / "data", {"train": VIDEOS // 4})
    out = tmp_path / "report"
    cache = f"dataset.metadata_cache={tmp_path / 'cache'}"
    args = ["--variants", "channels_last,amp", "--repeats", "1", "--no-combine", "--out", out]
    base = [
        *TINY,
        f"dataset.root={root}",
        cache,
        "trainer.max_steps=3",
        "trainer.log_every_n_steps=1",
    ]
    proc = run_cli([*args, *base], prog="accel-report", timeout=600)
    check_ok(proc)
    rows = list(csv.DictReader((out / "speed_report.csv").read_text().splitlines()))
    assert [r["variant"] for r in rows] == ["baseline", "channels_last", "amp"]
    assert all(r["status"] == "done" and float(r["samples_per_s"]) > 0 for r in rows), rows
    report = (out / "speed_report.md").read_text()
    assert "one training input of shape 3x4x32x32" in report and "clips/s" in report, report
    assert "channels_last: true" in (out / "channels_last" / "r0" / "config.yaml").read_text()
    amp = json.loads((out / "amp" / "r0" / "summary.json").read_text())
    assert amp["precision"].startswith("amp") and amp["sample_shape"] == [3, 4, 32, 32]
