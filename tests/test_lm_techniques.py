"""Every technique on a tiny GPT, through the real console scripts (issue 18): each precision,
compile, accumulation (and the loss division that replaces the normaliser's pass), DDP parity
with one process, FSDP, the pipeline split by blocks, activation checkpointing per block, EMA,
auto batch size, exact mid-run resume, rank-disjoint token windows, a sweep, accel-report and
accel-export to ONNX with a dynamic sequence length.

The model is 2 blocks, 32 wide, context 16; an epoch is 4 steps of 8 windows: each run costs
its start-up and little more."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import check_ok, read_jsonl

TEXT = "".join(f"def g{i}(y):\n    return y - {i} * {i % 5}\n\n" for i in range(200))
GPT = [
    "task=language_model",
    "model=gpt",
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=16",
    "dataset=tokens",
    "dataset.windows_per_epoch=32",
    "dataset.eval_windows=8",
    "loader.batch_size=8",
    "optimizer=adamw",
    "optimizer.lr=0.003",
    "trainer.max_epochs=1",
    "trainer.log_every_n_steps=1",
    "trainer.progress=none",
]


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory, run_cli_in):
    cwd = tmp_path_factory.mktemp("lm_tech")
    (cwd / "input.txt").write_text(TEXT)
    check_ok(run_cli_in(["tokenize", "input=input.txt", "out=tokens"], cwd, prog="accel-data"))
    return cwd


def _gpt(cwd: Path) -> list[str]:
    return [*GPT, f"dataset.path={cwd / 'tokens'}"]


# Clipped: the norm is over the whole model's gradients (the pipeline counts its tied embedding
# once, though two stages hold it), in every run compared with the one-process run.
CLIP = "trainer.gradient_clip_val=0.5"


@pytest.fixture(scope="module")
def single(lm_dir, run_cli_in) -> Path:
    """One process, batch 8, clipped: the reference of the accumulation, activation
    checkpointing, DDP, FSDP and pipeline runs, and the checkpoint exported to ONNX (one run,
    not one per test: each CLI run costs seconds of start-up)."""
    run = lm_dir / "single"
    check_ok(run_cli_in([*_gpt(lm_dir), CLIP, f"hydra.run.dir={run}"], lm_dir))
    return run


def _train_losses(run_dir: Path) -> dict[int, float]:
    return {
        r["step"]: r["train/loss"]
        for r in read_jsonl(run_dir / "metrics.jsonl")
        if "train/loss" in r
    }


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_every_precision_and_ema_train_a_gpt(lm_dir, run_cli_in):
    for precision in ("fp32", "amp", "bf16", "fp16", "bf16_true"):
        run = lm_dir / f"prec_{precision}"
        # fp32 also: EMA, and sampled lines at validation (task.sample_lines)
        extra = (
            ["ema.enabled=true", "ema.decay=0.5", "task.sample_lines=2", "task.sample_tokens=12"]
            if precision == "fp32"
            else []
        )
        proc = run_cli_in(
            [*_gpt(lm_dir), f"precision={precision}", *extra, f"hydra.run.dir={run}"], lm_dir
        )
        check_ok(proc)
        summary = _summary(run)
        assert np.isfinite(summary["final_val_loss"]), (precision, summary)
        assert summary["final_val_loss"] < np.log(len(set(TEXT))) + 0.5, (precision, summary)
        if precision == "fp16":
            assert "GradScaler" in summary["precision"], summary
        if extra:
            out = proc.stdout + proc.stderr
            assert "ema" in out
            assert "sample 1: '" in out and "sample 2: '" in out, out[-2000:]


def test_accumulation_equals_one_batch_and_checkpointing_per_block_changes_nothing(
    lm_dir, run_cli_in, single
):
    """batch 8 (the summed loss divided before backward) = 2 x 4 accumulated (the normaliser
    divides the gradients once, before clipping); activation checkpointing wraps each GPT
    block."""
    one = single
    two = lm_dir / "accum_2"
    ac = lm_dir / "ac_full"
    check_ok(
        run_cli_in(
            [
                *_gpt(lm_dir),
                CLIP,
                "loader.batch_size=4",
                "trainer.accumulate_grad_batches=2",
                f"hydra.run.dir={two}",
            ],
            lm_dir,
        )
    )
    proc = run_cli_in(
        [*_gpt(lm_dir), CLIP, "activation_checkpointing.mode=full", f"hydra.run.dir={ac}"],
        lm_dir,
    )
    check_ok(proc)
    assert "activation checkpointing (full): 2 of 2 blocks (Block)" in proc.stdout + proc.stderr
    a, b, c = _train_losses(one), _train_losses(two), _train_losses(ac)
    assert len(a) == 4 and a.keys() == b.keys() == c.keys()
    for step in a:
        assert a[step] == pytest.approx(b[step], abs=1e-5), (step, a, b)
        assert a[step] == pytest.approx(c[step], abs=1e-6), (step, a, c)


def test_ddp_matches_one_process_and_fsdp_and_pipeline_train(lm_dir, run_cli_in, single):
    gpt = [*_gpt(lm_dir), CLIP]  # clipped in every run, as `single` (see CLIP)
    two = ["launcher.nproc_per_node=2", "loader.batch_size=4"]
    ref = _train_losses(single)
    for strategy in ("ddp", "fsdp"):
        run = lm_dir / strategy
        proc = run_cli_in(
            [*gpt, *two, f"strategy={strategy}", f"hydra.run.dir={run}"],
            lm_dir,
            timeout=300,
        )
        check_ok(proc)
        got = _train_losses(run)
        assert got.keys() == ref.keys()
        for step in ref:
            assert abs(got[step] - ref[step]) < 1e-3, (strategy, step, got, ref)
    # The pipeline cuts the GPT, a chain of embed, blocks.0.., head, at its blocks: 2 stages.
    run = lm_dir / "pipeline"
    proc = run_cli_in(
        [
            *gpt,
            "launcher.nproc_per_node=2",
            "strategy=pipeline",
            "strategy.microbatches=2",
            "task.sample_lines=1",
            f"hydra.run.dir={run}",
        ],
        lm_dir,
        timeout=300,
    )
    check_ok(proc)
    assert "sample 1: '" in proc.stdout + proc.stderr  # sampling through the stages
    got = _train_losses(run)
    for step in ref:
        # (1e-4, tighter: untied stage copies of the embedding would drift further)
        assert abs(got[step] - ref[step]) < 1e-4, ("pipeline", step, got, ref)


def test_rank_windows_are_disjoint_and_cover_the_one_process_batches(lm_dir):
    from omegaconf import OmegaConf

    from accel_train.data.loaders import build_loader
    from accel_train.data.text.tokens import token_splits

    splits = token_splits(str(lm_dir / "tokens"), block_size=16, windows_per_epoch=32, seed=3)
    cfg = OmegaConf.create(
        {
            "name": "torch",
            "batch_size": 4,
            "eval_batch_size": 0,
            "num_workers": 0,
            "pin_memory": False,
            "persistent_workers": False,
            "prefetch_factor": 2,
            "multiprocessing_context": None,
            "drop_last": False,
            "shuffle": True,
        }
    )

    def windows(rank: int, world: int, batch: int) -> list[set[bytes]]:
        cfg.batch_size = batch
        loader = build_loader(
            splits.train,
            cfg,
            train=True,
            device=__import__("torch").device("cpu"),
            seed=3,
            rank=rank,
            world=world,
            limit=0,
            num_classes=0,
            labelled=False,
        )
        return [{row.numpy().tobytes() for row in x} for x, _ in loader.epoch(1)]

    one = windows(0, 1, 8)
    r0, r1 = windows(0, 2, 4), windows(1, 2, 4)
    for b, batch in enumerate(one):
        assert not r0[b] & r1[b]
        assert r0[b] | r1[b] == batch
    assert windows(0, 1, 8) == one  # seeded: the same windows again (exact resume)


def test_exact_mid_run_resume_on_a_gpt(lm_dir, run_cli_in):
    base = [*_gpt(lm_dir), "trainer.max_epochs=3", "trainer.ckpt_every_n_steps=1"]
    whole, cut = lm_dir / "whole", lm_dir / "cut"
    check_ok(run_cli_in([*base, f"hydra.run.dir={whole}"], lm_dir))
    check_ok(run_cli_in([*base, "trainer.max_steps=6", f"hydra.run.dir={cut}"], lm_dir))
    proc = run_cli_in([*base, "resume=auto", f"hydra.run.dir={cut}"], lm_dir)
    check_ok(proc)
    a, b = _train_losses(whole), _train_losses(cut)
    assert len(a) == 12 and a == b  # identical, not close: steps 7-12 ran after the resume


def test_a_sweep_report_and_compile_on_a_gpt(lm_dir, run_cli_in):
    sweep = lm_dir / "sweep"
    proc = run_cli_in(
        ["-m", *_gpt(lm_dir), "optimizer.lr=0.001,0.003", f"hydra.sweep.dir={sweep}"],
        lm_dir,
        timeout=300,
    )
    check_ok(proc)
    losses = [_summary(sweep / str(i))["final_val_loss"] for i in range(2)]
    assert all(np.isfinite(losses)) and losses[0] != losses[1]

    out = lm_dir / "report"
    proc = run_cli_in(
        [
            "--variants",
            "compile,bf16",
            "--repeats",
            "1",
            # Each switch on a GPT, once: the combination phase (a baseline and a compiled
            # best again) is tests/test_report.py's.
            "--no-combine",
            "--out",
            str(out),
            *_gpt(lm_dir),
            "loader.batch_size=auto",
            "loader.max_batch_size=16",
        ],
        lm_dir,
        prog="accel-report",
        timeout=600,
    )
    check_ok(proc)
    rows = list(csv.DictReader((out / "speed_report.csv").read_text().splitlines()))
    assert [r["variant"] for r in rows if r["phase"] == "1"] == ["baseline", "compile", "bf16"]
    assert all(r["status"] == "done" for r in rows), rows  # compile on a GPT included
    # loader.batch_size=auto probed the GPT's batch size in each run
    assert (out / "baseline" / "r0" / "batch_size_probe.csv").is_file()


def test_onnx_export_with_a_dynamic_sequence_length(lm_dir, run_cli_in, single):
    # A copy of the shared one-process run: the export writes beside the checkpoint.
    run = Path(shutil.copytree(single, lm_dir / "export_src"))
    ckpt = run / "checkpoints" / "last.pt"
    proc = run_cli_in([f"ckpt_path={ckpt}", "format=onnx"], lm_dir, prog="accel-export")
    check_ok(proc)
    card = json.loads((run / "checkpoints" / "last.onnx.json").read_text())
    check = card["verification"]
    assert check["passed"] and check["seq_lens"] == [16, 8], check
    assert check["max_abs_diff"] < 1e-3 and check["argmax_agreement"] > 0.999, check

    import onnxruntime as ort
    import torch

    from accel_train.checkpoint import load_checkpoint
    from accel_train.models.gpt import GPT

    session = ort.InferenceSession(
        str(run / "checkpoints" / "last.onnx"), providers=["CPUExecutionProvider"]
    )
    state = load_checkpoint(ckpt)
    model = GPT(
        vocab_size=state["model"]["embed.wte.weight"].shape[0],
        block_size=16,
        n_layer=2,
        n_head=2,
        n_embd=32,
    )
    model.load_state_dict(state["model"])
    model.eval()
    for t in (5, 16):  # two lengths, neither the example's batch
        x = torch.randint(0, model.vocab_size, (3, t))
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
        with torch.no_grad():
            assert np.abs(got - model(x).numpy()).max() < 1e-3
