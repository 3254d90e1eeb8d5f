"""Run `accel-train` and `accel-report` command lines the way their console scripts do, in one
process, up to the point where training would start: `accel-train` composes (aliases, the
schema, `-m` sweeps through their sweeper and launcher), validates, resolves and runs every
check `launch()` and the launcher's own `launch` run (checkpoint monitor, resume, strategy,
SLURM's keys, the Kubernetes manifest), and then starts and submits nothing; `accel-report`
checks every variant's config (its `plan`) and runs nothing.

    python tests/doc_dry_run.py commands.json results.json

commands.json: a list of {"argv": [...], "real": bool} (argv[0] the program). results.json: per
command its exit status and the tail of what it printed. tests/test_docs_commands.py runs it;
one process for all commands, as torch and Hydra are imported once.

"real": the command trains for real where it would train in this process (one process, no
cluster): its composed config shrunk as appended overrides would shrink it (SHRINK: the
images 32 px, a batch of 4, no loader workers, no compile; the command line itself appends
`+debug=fast_dev_run`), so a command that cannot start (a model that does not fit the data, a
schedule the model cannot take) fails here as it would for a reader (issue 47). A real line of
several processes on one node starts them (torchrun), its config shrunk alike and written again.
Each result has its wall and CPU seconds (this process and its workers).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
import traceback
from pathlib import Path

from hydra.core.global_hydra import GlobalHydra

from accel_train import cli
from accel_train.commands import report
from accel_train.config.facts import OBJECTIVES
from accel_train.config.run_config import write_run_config
from accel_train.errors import UserError
from accel_train.launchers import kubernetes_manifest, launch, ray_train, slurm_job, torchrun
from accel_train.launchers.worker import run_worker as real_worker


def _no_training(cfg) -> dict:
    """Instead of the workers: a summary.json, so that a sweep job reports an objective."""
    summary = dict.fromkeys(OBJECTIVES, 0.5)
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary))
    return summary


REAL = {"on": False}  # whether the command being run trains for real (see the docstring)
SIZE, BATCH = 32, 4  # the shrunk image side and batch


def _shrink(cfg) -> None:
    """What a reader would append to try a documented command on a laptop, where the composed
    config has those keys: images of at most 32 px, every image size scaled alike (so that
    sizes that do not fit each other still do not: a progressive schedule's against the
    model's) to a multiple of 16, clips of at most 8 frames and 2 views, batches of 4, no
    loader workers, no compile."""
    from omegaconf import open_dict

    with open_dict(cfg):
        ds, t = cfg.dataset, cfg.trainer
        side = int(ds.get("image_size") or 0)
        # (ImageNet weights need the ImageNet stem, which `stem: auto` picks above 64 px)
        size = 80 if cfg.model.get("weights") and cfg.model.get("stem") == "auto" else SIZE
        scale = size / side if side > size else 1.0

        def shrunk(x) -> int:  # (multiples of 16: a ViT's patch)
            return max(16, round(int(x) * scale / 16) * 16)

        for key in ("image_size", "eval_image_size"):
            if ds.get(key):
                ds[key] = shrunk(ds[key])
        if ds.get("resize_size"):  # (clips: evaluation's shorter side, at least the crop)
            ds.resize_size = 0 if "crop_pct" in ds else max(int(ds.image_size), SIZE)
        if ds.get("frames"):  # clips (dataset=video_folder): 8 frames, 2 views at most
            ds.frames = min(int(ds.frames), 8)
            ds.eval_clips = min(int(ds.get("eval_clips") or 1), 2)
        if t.get("progressive_resize") is not None:
            pr = t.progressive_resize
            for key in ("start_size", "end_size"):
                pr[key] = shrunk(pr.get(key, 160 if key == "start_size" else 192))
            pr.step = 16
        cfg.loader.batch_size = min(int(cfg.loader.batch_size), BATCH)
        if "num_workers" in cfg.loader:  # (loader=device has none; loader=ray needs an actor)
            cfg.loader.num_workers = 1 if cfg.loader.get("name") == "ray" else 0
        t.compile = False


def _worker(cfg) -> dict:
    if not REAL["on"]:
        return _no_training(cfg)
    _shrink(cfg)
    return real_worker(cfg)


_real_torchrun = torchrun.run_torchrun


def _torchrun(cfg, path: Path, nproc: int) -> dict | None:
    """A real command's processes on this node start for real (shrunk alike, its config
    written again); a multi-node line would wait for its other nodes: not started."""
    if not REAL["on"] or str(cfg.launcher.nnodes) != "1":
        return _no_training(cfg)
    _shrink(cfg)
    write_run_config(cfg, path.parent, path.name)
    return _real_torchrun(cfg, path, nproc)


# Stubbed: only what starts processes or reaches a cluster. Each launcher's own `launch` runs up
# to there (its strategy check, the config it writes), so a command refused there is refused
# here too (the canaries of tests/test_docs_commands.py).
torchrun.run_worker = _worker
torchrun.run_torchrun = _torchrun  # (a multi-node line would wait for its node0: not started)
slurm_job.submit = lambda cfg, path: None  # sbatch
ray_train.drive = lambda cfg, path, in_job=False: _no_training(cfg)  # no Ray started
ray_train.submit_job = lambda lc, path: "dry-run"
kubernetes_manifest.finish = lambda cfg, manifest: None  # checked against the models already
launch.hold_run_dir = lambda cfg: None  # this one process would hold every run dir's lock


def _report(argv: list[str]) -> None:
    opts, base = report.parse_args(argv)
    base = report.alias_overrides(base).argv
    wanted = [v.strip() for v in opts.variants.split(",") if v.strip()]
    try:
        report.plan(wanted, base, Path("outputs/speed_report/dry"))
    except UserError as err:
        print(f"accel-report: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def run(argv: list[str], real: bool = False) -> dict:
    out = io.StringIO()
    code = 0
    REAL["on"] = real
    with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        GlobalHydra.instance().clear()
        sys.argv = list(argv)
        try:
            if argv[0] == "accel-report":
                _report(argv[1:])
            else:
                cli.train()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - reported with the command
            traceback.print_exc()
            code = 1
    return {"argv": argv, "rc": code, "output": out.getvalue()[-4000:]}


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (a real command's workers)."""
    import resource

    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    commands_file, results_file = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    results = []
    for command in json.loads(commands_file.read_text()):
        start, cpu = time.perf_counter(), _cpu_s()
        result = run(command["argv"], command["real"])
        wall, cpu = time.perf_counter() - start, _cpu_s() - cpu
        results.append(result | {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)})
        results_file.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
