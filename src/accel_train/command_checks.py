"""The argument checks of accel-export and accel-eval: their own keys, checked by the CLI
before anything (torch included) is loaded, and the output paths they refuse to write."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from accel_train.errors import UserError
from accel_train.written import unwritable

# accel-export: format -> the artifact's suffix (beside the checkpoint: checkpoints/best.onnx).
# format -> the artifact's suffix (hf: a Hugging Face folder, see export_hf.py).
EXPORT_FORMATS = {
    "torch_export": ".pt2",
    "onnx": ".onnx",
    "torchscript": ".torchscript.pt",
    "hf": "-hf",
    "peft": "-peft",  # the LoRA adapters alone, as PEFT writes them (export_peft.py)
}
FOLDER_FORMATS = ("hf", "peft")  # formats that write a folder (they decide what they replace)
EXPORT_QUANTIZE = ("none", "int8")


def check_export_config(ecfg: DictConfig) -> None:
    """accel-export's own keys, before anything (torch included) is loaded."""
    formats, quantize = EXPORT_FORMATS, EXPORT_QUANTIZE
    if OmegaConf.is_missing(ecfg, "ckpt_path") or not ecfg.ckpt_path:
        raise UserError(
            "ckpt_path is required: the checkpoint to export, e.g. "
            "`accel-export ckpt_path=outputs/<run>/checkpoints/best.pt format=onnx`."
        )
    if ecfg.format not in formats:
        raise UserError(
            f"format={ecfg.format!r} is not one of {', '.join(formats)}. E.g. `format=onnx` "
            "(ONNX Runtime) or `format=torch_export` (torch.export.load / AOTInductor)."
        )
    if ecfg.quantize not in quantize:
        raise UserError(
            f"quantize={ecfg.quantize!r} is not one of {', '.join(quantize)}. "
            "`quantize=int8` is ONNX Runtime static quantization (with format=onnx)."
        )
    if ecfg.quantize == "int8" and ecfg.format != "onnx":
        raise UserError(
            f"quantize=int8 is ONNX Runtime static quantization and needs format=onnx, not "
            f"format={ecfg.format}. Use `format=onnx quantize=int8` (or train with quant=qat "
            "for an int8 torch.export artifact)."
        )
    if ecfg.batch_size < 0 or ecfg.verify_samples < 0 or ecfg.calib_batches < 1:
        raise UserError(
            f"batch_size={ecfg.batch_size} and verify_samples={ecfg.verify_samples} must be "
            f">= 0 and calib_batches={ecfg.calib_batches} >= 1."
        )
    if not 0.0 <= ecfg.min_agreement <= 1.0:
        raise UserError(f"min_agreement={ecfg.min_agreement} is a fraction in [0, 1], e.g. 0.999.")
    ckpt_path = Path(ecfg.ckpt_path).expanduser()
    if ckpt_path.is_dir() and not (ckpt_path / "meta.pt").is_file():
        raise UserError(
            f"ckpt_path={ckpt_path} is a directory, not a checkpoint: give a .pt file written "
            "by accel-train (e.g. outputs/<run>/checkpoints/best.pt) or an FSDP .dcp directory "
            "(which holds meta.pt)."
        )
    if ecfg.out_path and ecfg.format in FOLDER_FORMATS:  # the exporter decides what it replaces
        refuse_checkpoint_target(str(ecfg.ckpt_path), str(ecfg.out_path), "exports/my-model")
    elif ecfg.out_path:
        check_export_target(str(ecfg.ckpt_path), str(ecfg.out_path), bool(ecfg.overwrite))
    check_writable(export_path(ecfg), bool(ecfg.out_path))


# accel-eval: the devices it runs on, and the splits of a run's data set it scores.
EVAL_DEVICES = ("auto", "cpu", "cuda")
EVAL_SPLITS = ("test", "val", "train")


def check_eval_config(ecfg: DictConfig) -> None:
    """accel-eval's own keys, before anything (torch included) is loaded, in the order
    train/evaluate.py checks them (it asks whether device=cuda has a device after these)."""
    check_sources(ecfg)
    if not ecfg.harness.tasks:
        check_ckpt_path(ecfg)
        check_eval_keys(ecfg)
    elif not ecfg.model_path:
        check_ckpt_path(ecfg)
    check_device_name(ecfg)


def check_sources(ecfg: DictConfig) -> None:
    """ckpt_path xor model_path; model_path only with harness.tasks."""
    has_ckpt = not OmegaConf.is_missing(ecfg, "ckpt_path") and bool(ecfg.ckpt_path)
    if has_ckpt and ecfg.model_path:
        raise UserError(
            f"ckpt_path={ecfg.ckpt_path} and model_path={ecfg.model_path} are both given: "
            "accel-eval scores one model at a time. Give ckpt_path for a run's checkpoint, or "
            "model_path for a Hugging Face folder (e.g. the base the run was fine-tuned from), "
            "and run accel-eval once for each."
        )
    if ecfg.model_path and not ecfg.harness.tasks:
        raise UserError(
            f"model_path={ecfg.model_path} scores a Hugging Face folder on lm-evaluation-harness "
            "tasks only (it has no run's data set to score): add `harness.tasks=[NAME,...]` "
            "(and `harness.include_path=DIR` for your own task files)."
        )


def check_ckpt_path(ecfg: DictConfig) -> Path:
    if OmegaConf.is_missing(ecfg, "ckpt_path") or not ecfg.ckpt_path:
        raise UserError(
            "ckpt_path is required: the checkpoint to evaluate, e.g. "
            "`accel-eval ckpt_path=outputs/<run>/checkpoints/best.pt` (or, with harness.tasks, "
            "`model_path=DIR`: a Hugging Face folder)."
        )
    ckpt_path = Path(ecfg.ckpt_path).expanduser()
    if ckpt_path.is_dir() and not (ckpt_path / "meta.pt").is_file():
        found = sorted(
            str(p.relative_to(ckpt_path))
            for pattern in ("*.pt", "*.dcp", "checkpoints/*.pt", "checkpoints/*.dcp")
            for p in ckpt_path.glob(pattern)
        )
        hint = f" It holds {', '.join(found[:4])}: give one of those." if found else ""
        raise UserError(
            f"ckpt_path={ckpt_path} is a directory, not a checkpoint: give a .pt file written by "
            "accel-train (e.g. outputs/<run>/checkpoints/best.pt) or an FSDP .dcp directory "
            f"(which holds meta.pt).{hint}"
        )
    return ckpt_path


def check_eval_keys(ecfg: DictConfig) -> None:
    """accel-eval's keys for scoring a run's checkpoint on its data set."""
    if ecfg.batch_size < 0:
        raise UserError(
            f"batch_size={ecfg.batch_size} must be >= 0 (0 = the checkpoint's own "
            "loader.eval_batch_size), e.g. `batch_size=1024`."
        )
    if ecfg.split is not None and ecfg.split not in EVAL_SPLITS:
        raise UserError(
            f"split={ecfg.split!r} is not one of {', '.join(EVAL_SPLITS)}: the split of the "
            "checkpoint's data set to score, e.g. `split=val`."
        )
    if ecfg.data_path and not Path(ecfg.data_path).expanduser().is_file():
        raise UserError(
            f"data_path={ecfg.data_path}: no such file. Give a file of records in the "
            "checkpoint's data format (e.g. a .jsonl of chat records for dataset=sft)."
        )
    if ecfg.out_path:
        refuse_checkpoint_target(str(ecfg.ckpt_path), str(ecfg.out_path), "eval/result.json")
        _refuse_foreign_result(Path(ecfg.out_path))


def check_device_name(ecfg: DictConfig) -> None:
    if ecfg.device not in EVAL_DEVICES:
        raise UserError(
            f"device={ecfg.device!r} is not one of {', '.join(EVAL_DEVICES)}. Use `device=cpu` "
            "or `device=auto`."
        )


def _refuse_foreign_result(out: Path) -> None:
    """An existing out_path is replaced only when it is an earlier accel-eval result."""
    if not out.is_file():
        return
    try:
        earlier = json.loads(out.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        earlier = None
    if not (isinstance(earlier, dict) and "ckpt_path" in earlier and "split" in earlier):
        raise UserError(
            f"out_path={out} exists and is not an accel-eval result: accel-eval replaces only "
            "its own result files. Choose another `out_path` (e.g. `out_path=eval/result.json`)."
        )


def export_path(ecfg: DictConfig) -> Path:
    """Where accel-export writes: out_path, or beside the checkpoint (checkpoints/best.onnx,
    checkpoints/best-hf)."""
    if ecfg.out_path:
        return Path(ecfg.out_path).expanduser()
    return default_export_path(Path(ecfg.ckpt_path).expanduser(), ecfg.format)


def default_export_path(ckpt_path: Path, fmt: str) -> Path:
    return ckpt_path.with_name(ckpt_path.name.split(".")[0] + EXPORT_FORMATS[fmt])


def check_writable(out: Path, given: bool) -> None:
    """An output path nothing can be written to (read-only, /proc, no permission) is refused
    now, before the checkpoint is read and the model exported or scored."""
    reason = unwritable(out)
    if reason is not None:
        key = "out_path" if given else "out_path (by default beside the checkpoint)"
        raise UserError(
            f"{key}={out}: nothing can be written there ({reason}). Give a path in a writable "
            "folder with `out_path=...`."
        )


def _is_run_checkpoint(path: Path) -> bool:
    """A name accel-train's checkpoints take in a run's checkpoints/ folder (last.pt, best.pt,
    epoch=3-step=120.pt, last.dcp); exported artifacts there end in .pt2, .onnx or
    .torchscript.pt."""
    if path.parent.name != "checkpoints" or path.name.endswith(EXPORT_FORMATS["torchscript"]):
        return False
    return path.suffix in (".pt", ".dcp")


def refuse_checkpoint_target(ckpt_path: str, out_path: str, example: str) -> None:
    """An output path (accel-export's artifact, accel-eval's result) is never the checkpoint
    being read nor any run's checkpoint: best.pt would be lost, and a last.pt replaced by
    something else makes resume=auto refuse the run."""
    out = Path(out_path).expanduser().resolve()
    same = out == Path(ckpt_path).expanduser().resolve()
    if same or _is_run_checkpoint(out):
        what = "the checkpoint being read" if same else "a run's checkpoint"
        raise UserError(
            f"out_path={out_path} is {what}: writing there would replace it, whatever "
            f"`overwrite` says. Write elsewhere, e.g. `out_path={example}`, or leave out_path "
            "out (the output then goes beside the checkpoint under a name of its own)."
        )


def check_export_target(ckpt_path: str, out_path: str, overwrite: bool) -> None:
    """An explicit out_path never replaces a checkpoint, and an existing file only with
    overwrite=true and only when it is an earlier export, unchanged since (_earlier_export)."""
    refuse_checkpoint_target(ckpt_path, out_path, "exports/model.onnx")
    out = Path(out_path).expanduser()
    card = out.with_name(out.name + ".json")
    existing = [str(p) for p in (out, card) if p.exists()]
    if existing and not overwrite:
        raise UserError(
            f"out_path={out_path}: {' and '.join(existing)} "
            f"{'exist' if len(existing) > 1 else 'exists'} already (the artifact and its card). "
            "Choose another `out_path`, or replace them with `overwrite=true`."
        )
    if existing and not _earlier_export(out, card):
        raise UserError(
            f"out_path={out_path}: {' and '.join(existing)} "
            f"{'are' if len(existing) > 1 else 'is'} not an earlier accel-export's artifact and "
            f"card (its card, {card.name}, names the artifact and its size, and the artifact is "
            "unchanged since), so it is not accel-export's to replace, whatever `overwrite` "
            "says. Choose another `out_path`, or move the file away yourself."
        )


def _earlier_export(out: Path, card: Path) -> bool:
    """The card accel-export wrote beside `out` names it, and `out` still has the size the card
    recorded: a file merely at an artifact's name is not proof that accel-export wrote it."""
    try:
        written = json.loads(card.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return (
        isinstance(written, dict)
        and Path(str(written.get("artifact", ""))).name == out.name
        and out.is_file()
        and written.get("file_bytes") == out.stat().st_size
    )
