#!/usr/bin/env python
"""Export and quantization on real MNIST: accuracy, size and CPU inference latency.

Runs, as subprocesses through the real console scripts (skipped for a run dir given with
--fp32-run / --qat-run that already holds checkpoints/best.pt):

    accel-train model=mnist_cnn dataset=mnist trainer.max_epochs=3 paths.data_dir=DATA \
        hydra.run.dir=RUN_FP32
    accel-train ... quant=qat hydra.run.dir=RUN_QAT
    accel-export ckpt_path=RUN_FP32/checkpoints/best.pt format=torch_export
    accel-export ckpt_path=RUN_FP32/checkpoints/best.pt format=onnx quantize=int8
    accel-export ckpt_path=RUN_QAT/checkpoints/best.pt format=torch_export
    accel-export ckpt_path=RUN_QAT/checkpoints/best.pt format=onnx

then reads the test accuracies from the cards, and in this process times one forward of a
batch of 1 and of 256 real test images for each variant: fp32 eager, torch.compile, the
torch.export artifact (torch.export.load(...).module()), ONNX Runtime fp32, ONNX Runtime int8
(static QDQ), and the QAT model converted by torchao (torch.export and ONNX Runtime). Variants
alternate within each round (so a change in the machine's load hits all of them); reported is
the median over rounds of the per-call CPU time (process_time) and wall time, with the load
average before and after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_DATA_DIR,
    REPO,
    child_env,
    console_script,
    load_avg,
    machine,
    run_child,
    table,
)


def sh(cmd: list[str]) -> float:
    proc, usage = run_child(cmd, child_env(None))
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "->" in ln or "done:" in ln]
    print("\n".join(f"    {ln}" for ln in lines[-3:]))
    return usage["wall"]


def train(run_dir: Path, data_dir: str, epochs: int, extra: list[str]) -> None:
    if (run_dir / "checkpoints" / "best.pt").is_file():
        print(f"reusing {run_dir}")
        return
    cmd = [
        console_script("accel-train"),
        "model=mnist_cnn",
        "dataset=mnist",
        f"trainer.max_epochs={epochs}",
        "trainer.progress=none",
        f"paths.data_dir={data_dir}",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]
    print("$", " ".join(cmd))
    wall = sh(cmd)
    print(f"    ({wall:.0f} s)")


def export(ckpt: Path, *args: str) -> None:
    cmd = [console_script("accel-export"), f"ckpt_path={ckpt}", *args]
    print("$", " ".join(cmd))
    wall = sh(cmd)
    print(f"    ({wall:.0f} s)")


def card(artifact: Path) -> dict:
    return json.loads(artifact.with_name(artifact.name + ".json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench_export")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=7, help="alternating timing rounds")
    ap.add_argument("--calls", type=int, default=20, help="forwards per variant per round (b=1)")
    args = ap.parse_args()

    fp32_run, qat_run = args.out / "fp32", args.out / "qat"
    print(f"machine: {machine()}; load before: {load_avg()}")
    train(fp32_run, args.data_dir, args.epochs, [])
    train(qat_run, args.data_dir, args.epochs, ["quant=qat"])
    fp32_ckpt, qat_ckpt = fp32_run / "checkpoints" / "best.pt", qat_run / "checkpoints" / "best.pt"
    export(fp32_ckpt, "format=torch_export")
    export(fp32_ckpt, "format=onnx", "quantize=int8")
    qat_pt2 = qat_run / "checkpoints" / "qat.pt2"
    qat_onnx = qat_run / "checkpoints" / "qat.onnx"
    export(qat_ckpt, "format=torch_export", f"out_path={qat_pt2}")
    export(qat_ckpt, "format=onnx", f"out_path={qat_onnx}")

    import onnxruntime as ort
    import torch

    from accel_train.checkpoint import load_checkpoint
    from accel_train.config.run_config import typed
    from accel_train.data.build import build_splits
    from accel_train.models import build_model

    torch.manual_seed(0)
    state = load_checkpoint(fp32_ckpt)
    cfg = typed(state["config"])
    splits = build_splits(cfg.dataset, args.data_dir)
    eager = build_model(cfg.model, splits.data_args)
    eager.load_state_dict(state["model"])
    eager.eval()
    compiled = torch.compile(eager)
    images = torch.stack([splits.test[i][0] for i in range(256)]).float()
    mean, std = cfg.dataset.mean[0], cfg.dataset.std[0]
    x256 = ((images / 255 - mean) / std).contiguous()
    x1 = x256[:1].contiguous()

    def ort_runner(path: Path):
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        s = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        name = s.get_inputs()[0].name
        return lambda x: s.run(None, {name: x.numpy()})[0]

    ckpts = fp32_run / "checkpoints"
    variants = {
        "fp32 eager": eager,
        "torch.compile": compiled,
        "torch.export (.pt2)": torch.export.load(ckpts / "best.pt2").module(),
        "ONNX Runtime fp32": ort_runner(ckpts / "best.onnx"),
        "ONNX Runtime int8 (PTQ)": ort_runner(ckpts / "best.int8.onnx"),
        "QAT torch.export (.pt2)": torch.export.load(qat_pt2).module(),
        "QAT ONNX Runtime": ort_runner(qat_onnx),
    }
    cards = {
        "fp32 eager": card(ckpts / "best.pt2"),
        "torch.compile": card(ckpts / "best.pt2"),
        "torch.export (.pt2)": card(ckpts / "best.pt2"),
        "ONNX Runtime fp32": card(ckpts / "best.onnx"),
        "ONNX Runtime int8 (PTQ)": card(ckpts / "best.int8.onnx"),
        "QAT torch.export (.pt2)": card(qat_pt2),
        "QAT ONNX Runtime": card(qat_onnx),
    }
    files = {
        "fp32 eager": fp32_ckpt,
        "torch.compile": fp32_ckpt,
        "torch.export (.pt2)": ckpts / "best.pt2",
        "ONNX Runtime fp32": ckpts / "best.onnx",
        "ONNX Runtime int8 (PTQ)": ckpts / "best.int8.onnx",
        "QAT torch.export (.pt2)": qat_pt2,
        "QAT ONNX Runtime": qat_onnx,
    }
    with torch.no_grad():
        for fn in variants.values():  # warm-up (and compile)
            for x in (x1, x256, x1, x256):
                fn(x)
        per = {(name, b): ([], []) for name in variants for b in (1, 256)}
        load_before = load_avg()
        for _ in range(args.rounds):
            for name, fn in variants.items():
                for b, x, calls in ((1, x1, args.calls), (256, x256, max(1, args.calls // 10))):
                    c0, w0 = time.process_time(), time.perf_counter()
                    for _ in range(calls):
                        fn(x)
                    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
                    per[name, b][0].append(1000 * cpu / calls)
                    per[name, b][1].append(1000 * wall / calls)
        load_after = load_avg()

    rows = []
    for name in variants:
        c = cards[name]
        v = c["verification"]
        acc = (
            v["artifact_test_acc"]
            if name not in ("fp32 eager", "torch.compile")
            else (v["pytorch_test_acc"])
        )
        med = {b: [statistics.median(xs) for xs in per[name, b]] for b in (1, 256)}
        rows.append(
            [
                name,
                f"{100 * acc:.2f}%",
                f"{c['model']['parameters']:,}",
                f"{files[name].stat().st_size / 2**20:.2f} MiB",
                f"{med[1][0]:.3f} / {med[1][1]:.3f}",
                f"{med[256][0]:.1f} / {med[256][1]:.1f}",
            ]
        )
    print()
    print(
        f"MNIST test split ({cards['ONNX Runtime fp32']['verification']['samples']} images), "
        f"{args.rounds} alternating rounds, torch threads {torch.get_num_threads()}; "
        f"load {load_before} before / {load_after} after timing"
    )
    print(
        table(
            [
                "variant",
                "test acc",
                "parameters",
                "file",
                "b=1 ms CPU / wall (median)",
                "b=256 ms CPU / wall (median)",
            ],
            rows,
        )
    )
    q = cards["ONNX Runtime int8 (PTQ)"]["quantization"]
    print(
        f"PTQ int8: test acc {100 * q['test_acc_before']:.2f}% -> {100 * q['test_acc_after']:.2f}% "
        f"({q['calibration']}); QAT run summary test acc "
        f"{cards['QAT torch.export (.pt2)']['accuracy_in_run_summary'].get('test_acc')}"
    )


if __name__ == "__main__":
    main()
