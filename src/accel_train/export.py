"""`accel-export`: a checkpoint -> a deployable artifact (torch.export, ONNX or TorchScript),
verified in its real consumer, with a JSON card beside it.

The model is rebuilt from the checkpoint's own config (as `accel-eval` does, a user's
``_target_`` model included), loaded with the project's safe loader (an FSDP ``.dcp`` directory
is consolidated into one process's model), and exported in float32 with a dynamic batch
dimension. A ``quant=qat`` checkpoint is prepared again and converted with torchao first, so
its artifact holds int8 Linear weights. ``quantize=int8`` adds ONNX Runtime static
quantization (QDQ, per-channel weights) calibrated on validation batches.

Every artifact is loaded back by what a deployment would use (``torch.export.load``,
``onnxruntime.InferenceSession``, ``torch.jit.load``) and run on real test batches next to the
PyTorch model: the max abs difference of the logits and the argmax agreement are reported, and
an agreement below ``min_agreement`` fails (for an int8 artifact, whose rounding is meant to
change outputs, the accuracy before and after is reported instead).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from accel_train.command_checks import EXPORT_FORMATS, check_export_config, export_path
from accel_train.config.facts import task_class
from accel_train.data.build import build_splits
from accel_train.data.builtin import hints_for
from accel_train.data.loaders import build_loader
from accel_train.data.splits import Splits
from accel_train.data.transform import BatchTransform
from accel_train.errors import UserError
from accel_train.export_hf import export_hf
from accel_train.export_peft import export_peft
from accel_train.loggers import json_safe
from accel_train.models import count_parameters
from accel_train.run_checkpoint import RunCheckpoint
from accel_train.techniques import qat
from accel_train.techniques.lora import merge_lora
from accel_train.written import make_parents, remove_empty

log = logging.getLogger("accel_train")

FORMATS = EXPORT_FORMATS  # format -> the artifact's suffix
ONNX_EXTRA = "onnx"  # pip install 'accel-train[onnx]': onnx, onnxscript, onnxruntime
CPU = torch.device("cpu")


def export_checkpoint(ecfg: DictConfig) -> dict[str, Any]:
    """The body of `accel-export`. Returns the card (also written beside the artifact)."""
    ckpt_path = _check_export_config(ecfg)
    fmt, quantize = ecfg.format, ecfg.quantize
    if fmt == "hf":
        return export_hf(ecfg, ckpt_path)
    if fmt == "peft":
        return export_peft(ecfg, ckpt_path)
    if fmt == "onnx" or quantize == "int8":
        _onnx_modules()  # a missing extra fails before anything is loaded
    run = _open_run(ecfg, ckpt_path)
    cfg, text = run.cfg, run.text
    splits, verify_split = _verify_data(ecfg, cfg, ckpt_path, text)
    model, sparsity, params = _float_model(run, splits)
    transform = BatchTransform(cfg.dataset, splits, CPU, torch.float32, seed=0, rank=0)
    test = _batches(verify_split, cfg, splits, None if text else transform, ecfg.verify_samples)
    # Two samples: torch.export specialises a dimension whose example size is 0 or 1.
    example = torch.cat([test[0][0], test[0][0]])[:2]
    artifact = export_path(ecfg)
    t0 = time.perf_counter()
    _export(model, example, fmt, artifact, seq_dim=text)
    export_s = time.perf_counter() - t0
    check = _verify(model, fmt, artifact, test, example, text, ckpt_path)
    check["passed"] = check["argmax_agreement"] >= ecfg.min_agreement
    state = run.opened.state
    card = _card(
        ecfg, cfg, ckpt_path, state, splits, artifact, fmt, params, sparsity, check, export_s
    )
    if text:
        card.update(_text_io(splits, example.shape[1]))
    elif example.dim() == 5:  # clips: (batch, channels, frames, height, width)
        card["input"].update(shape=["batch", *example.shape[1:]], layout="NCTHW, contiguous")
    card["quantization"] = qat.describe(run.quant) if run.is_qat else None
    _write_card(card, artifact)
    _refuse_disagreement(ecfg, check, artifact)
    if quantize == "int8":
        card = _int8(ecfg, cfg, splits, transform, artifact, card, model, test)
    return card


@dataclass
class _Run:
    """The checkpoint to export, opened, with what its config says of the export."""

    opened: RunCheckpoint
    cfg: DictConfig
    text: bool  # a language model: token ids in, logits over the vocabulary out
    quant: Any  # its `quant` group (None: a checkpoint written before it)
    is_qat: bool


def _open_run(ecfg: DictConfig, ckpt_path: Path) -> _Run:
    """The checkpoint opened, refused when no artifact can hold its model; `ecfg`'s data_dir and
    batch_size replace its paths.data_dir and loader.eval_batch_size."""
    opened = RunCheckpoint(ckpt_path, redo="Export it with the version that wrote it.")
    cfg = opened.cfg
    task = task_class(cfg)
    quant = cfg.quant if "quant" in cfg and not OmegaConf.is_missing(cfg, "quant") else None
    is_qat = quant is not None and quant.name == "qat"
    _refuse_unexportable(cfg, ckpt_path, ecfg, task, is_qat)
    if ecfg.data_dir:
        cfg.paths.data_dir = ecfg.data_dir
    if ecfg.batch_size:
        cfg.loader.eval_batch_size = ecfg.batch_size
    return _Run(opened, cfg, _generates_text(task), quant, is_qat)


def _verify_data(
    ecfg: DictConfig, cfg: DictConfig, ckpt_path: Path, text: bool
) -> tuple[Splits, Any]:
    """(the splits, the split the export is verified on): the test split; a set without one (an
    image folder of train/ and val/, as ImageNet's; a text set) verifies on validation samples:
    agreement needs inputs, not labels."""
    with hints_for("accel-export"):  # data errors name `data_dir=`, not paths.data_dir
        splits = build_splits(cfg.dataset, cfg.paths.data_dir, labelled=not text)
    verify_split = splits.test if splits.test is not None else splits.val
    if splits.test is None and verify_split is not None:
        log.info("accel-export: the data set has no test split: verifying on validation samples")
    if verify_split is None:
        raise UserError(
            f"ckpt_path={ckpt_path}: the checkpoint's data set ({cfg.dataset.get('name')}) has "
            "no test split to verify the export on. Give it one (for dataset=custom: return "
            "(train, val, test))."
        )
    return splits, verify_split


def _float_model(run: _Run, splits: Splits) -> tuple[nn.Module, dict[str, Any], int]:
    """(the model to export, its sparsity, its parameter count): float32 whatever the training,
    a .dcp consolidated into this process, LoRA adapters folded into their base weights (the
    architecture as it was built: an artifact has no use for PEFT's layers), a QAT model
    converted to its int8 Linear weights."""
    quant = run.quant
    model = run.opened.model(
        splits.data_args,
        torch.float32,
        CPU,
        before_load=(
            (lambda m: qat.prepare_qat(m, quant, run.cfg.model._target_)) if run.is_qat else None
        ),
        weights=_permanent_masks,
    )
    model = merge_lora(model)
    sparsity = _sparsity(model)
    params = count_parameters(model)
    if run.is_qat:
        qat.convert_qat(model, quant)
    return model, sparsity, params


def _refuse_disagreement(ecfg: DictConfig, check: dict[str, Any], artifact: Path) -> None:
    if not check["passed"]:
        raise UserError(
            f"the exported {artifact} disagrees with the PyTorch model: argmax agreement "
            f"{100 * check['argmax_agreement']:.3f}% < min_agreement "
            f"{100 * ecfg.min_agreement:.3f}% on {check['samples']} test samples (max abs diff "
            f"{check['max_abs_diff']:.3g}). The artifact and its card are kept for inspection; "
            f"try another format (one of {', '.join(FORMATS)})."
        )


def _generates_text(task: type | None) -> bool:
    """A text model (token ids in, next-token logits out) is verified by its next-token argmax
    at two sequence lengths; its artifact takes any length up to the trained context."""
    return task is not None and getattr(task, "generates_text", False)


def _refuse_unexportable(
    cfg: DictConfig, ckpt_path: Path, ecfg: DictConfig, task: type | None, is_qat: bool
) -> None:
    """What accel-export cannot verify or write for this checkpoint, before any data loads."""
    quantize, fmt, text = ecfg.quantize, ecfg.format, _generates_text(task)
    if text and quantize == "int8":
        raise UserError(
            f"ckpt_path={ckpt_path} is a language model (task={cfg.task.get('name')}): "
            "quantize=int8 calibrates on image batches and is not wired for token ids. Drop "
            "`quantize=int8` (the fp32 export works), or quantize the ONNX file yourself."
        )
    if task is not None and not getattr(task, "class_logits", False) and not text:
        raise UserError(
            f"ckpt_path={ckpt_path} was trained with task={cfg.task.get('name')}: accel-export "
            "verifies an artifact by its class predictions (argmax agreement with the PyTorch "
            "model on the test split), which only task=classification has. Export this model "
            "with torch.export or torch.onnx.export directly, or use accel-eval to score it."
        )
    if is_qat and quantize == "int8":
        raise UserError(
            f"ckpt_path={ckpt_path} was trained with quant=qat: its export is already int8 "
            "(torchao's convert step runs first). Drop `quantize=int8`."
        )
    if is_qat and fmt == "torchscript":
        raise UserError(
            f"ckpt_path={ckpt_path} was trained with quant=qat, and TorchScript's tracer cannot "
            "capture torchao's int8 weights. Use `format=torch_export` or `format=onnx`."
        )


def _verify(model, fmt: str, artifact: Path, test, example, text: bool, ckpt_path: Path) -> dict:
    """The artifact loaded back by its real consumer and compared with the PyTorch model."""
    run = _load_runner(fmt, artifact)
    if text:  # the full context and half of it: the sequence length is dynamic
        full = example.shape[1]
        lens = [full, max(2, full // 2)]
        check = _compare_text(model, run, test, lens)
    else:
        check = _compare(model, run, test)
    log.info(
        "%s -> %s (%s): max abs diff %.3g, argmax agreement %.4f%% on %d test samples; "
        "test acc %.4f (PyTorch) / %.4f (artifact)",
        ckpt_path,
        artifact,
        _size(artifact.stat().st_size),
        check["max_abs_diff"],
        100 * check["argmax_agreement"],
        check["samples"],
        check["pytorch_test_acc"],
        check["artifact_test_acc"],
    )
    return check


# ---- checks ------------------------------------------------------------------------------


def _check_export_config(ecfg: DictConfig) -> Path:
    check_export_config(ecfg)  # (the CLI ran it already, before importing torch)
    return Path(ecfg.ckpt_path).expanduser()


def _onnx_modules():
    try:
        import onnx  # noqa: F401  (torch.onnx.export writes through it)
        import onnxruntime
        import onnxscript  # noqa: F401  (torch.onnx's exporter translates with it)
    except ImportError as err:
        raise UserError(
            f"format=onnx and quantize=int8 need onnx, onnxscript and onnxruntime ({err}). "
            f"Install the extra: `pip install 'accel-train[{ONNX_EXTRA}]'`."
        ) from None
    return onnxruntime


# ---- the model ----------------------------------------------------------------------------


def _permanent_masks(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state_dict with torch.nn.utils.prune's reparametrisation still in it (`w_orig` and
    `w_mask`) folded into plain `w = w_orig * w_mask`, as prune.remove would have."""
    out = dict(weights)
    for key in [k for k in weights if k.endswith("_orig")]:
        mask_key = key.removesuffix("_orig") + "_mask"
        if mask_key in weights:
            out[key.removesuffix("_orig")] = weights[key] * weights[mask_key]
            del out[key], out[mask_key]
    return out


def _sparsity(model: nn.Module) -> dict[str, Any]:
    """Share of exact zeros in the conv / linear weights (what pruning leaves)."""
    zeros = total = 0
    for m in model.modules():
        if isinstance(m, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d):
            w = m.weight.detach()
            zeros += int((w == 0).sum())
            total += w.numel()
    return {"weight_zeros": zeros, "weights": total, "fraction": zeros / max(total, 1)}


def _batches(split, cfg: DictConfig, splits: Splits, transform, limit: int):
    """The first `limit` samples of a split (0 = all) as (normalised inputs, labels) batches."""
    loader = build_loader(
        split,
        cfg.loader,
        train=False,
        device=CPU,
        seed=0,
        rank=0,
        world=1,
        limit=0,
        num_classes=splits.num_classes,
        labelled=transform is not None,  # token windows: the targets are ids, not classes
    )
    out, n = [], 0
    for images, labels, *_ in loader.epoch(0):  # (a per-sample group, Splits.groups: unused)
        x = images if transform is None else transform(images, train=False).contiguous()
        if len(x) != len(labels):  # several views of each sample (a video's clips): per view
            labels = labels.repeat_interleave(len(x) // len(labels))
        if limit and n + len(x) > limit:
            x, labels = x[: limit - n], labels[: limit - n]
        out.append((x, labels))
        n += len(x)
        if limit and n >= limit:
            break
    return out


# ---- exporting and loading back ------------------------------------------------------------


def _export(
    model: nn.Module, example: torch.Tensor, fmt: str, path: Path, seq_dim: bool = False
) -> None:
    """Write the artifact; a model the exporter cannot capture is a UserError naming it.
    `seq_dim`: token ids (batch, time), the time dimension dynamic up to the example's."""
    batch = torch.export.Dim("batch", min=1)
    dims = {0: batch}
    if seq_dim:
        dims[1] = torch.export.Dim("seq", min=1, max=example.shape[1])
    for name in ("onnxscript", "onnx_ir"):  # the ONNX optimizer's per-pass INFO lines
        logging.getLogger(name).setLevel(logging.WARNING)
    made: list[Path] = []
    try:
        made = make_parents(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # exporters' deprecation chatter: not the user's
            if fmt == "torch_export":
                program = torch.export.export(model, (example,), dynamic_shapes=(dims,))
                torch.export.save(program, path)
            elif fmt == "onnx":
                torch.onnx.export(
                    model,
                    (example,),
                    path,
                    input_names=["input"],
                    output_names=["logits"],
                    dynamic_shapes=(dims,),
                    dynamo=True,
                    external_data=False,  # one self-contained file (models under 2 GB)
                    verbose=False,
                )
            else:  # torchscript: deprecated upstream, kept because tracing is cheap
                with torch.no_grad():
                    traced = torch.jit.trace(model, example)
                torch.jit.save(traced, str(path))
    except OSError as err:
        remove_empty(made)  # a failed export leaves no folder of its own behind
        raise UserError(
            f"out_path={path}: the artifact could not be written ({err.strerror or err}). "
            "Give a writable path with `out_path=...`."
        ) from None
    except Exception as err:  # the exporter could not capture the model
        remove_empty(made)
        first = " ".join(str(err).split())[:300]
        others = ", ".join(f for f in FORMATS if f != fmt)
        raise UserError(
            f"format={fmt}: the model could not be exported ({type(err).__name__}: {first}). "
            f"Try another format ({others}) or make the model's forward traceable."
        ) from None


def _load_runner(fmt: str, path: Path):
    """The artifact loaded by its real consumer: a function float32 NCHW array -> logits."""
    if fmt == "torch_export":
        module = torch.export.load(path).module()
        return lambda x: module(torch.from_numpy(x)).detach().numpy()
    if fmt == "torchscript":
        module = torch.jit.load(str(path))
        return lambda x: module(torch.from_numpy(x)).detach().numpy()
    session = _session(path)
    name = session.get_inputs()[0].name
    return lambda x: session.run(None, {name: x})[0]


@torch.no_grad()
def _compare_text(model: nn.Module, run, batches, lens: list[int]) -> dict[str, Any]:
    """A text artifact vs PyTorch on the same token windows, cut to each of `lens` tokens: max
    abs diff of the logits, next-token argmax agreement and accuracy, over every position."""
    max_diff, agree, ref_correct, art_correct, n = 0.0, 0, 0, 0, 0
    for t in lens:
        for x, labels in batches:
            x, y = x[:, :t].contiguous(), labels[:, :t].numpy()
            ref = model(x).float().numpy()
            out = np.asarray(run(x.numpy()), dtype=np.float32)
            max_diff = max(max_diff, float(np.abs(out - ref).max()))
            a, b = ref.argmax(-1), out.argmax(-1)
            agree += int((a == b).sum())
            ref_correct += int((a == y).sum())
            art_correct += int((b == y).sum())
            n += y.size
    return {
        "samples": n,  # token positions
        "seq_lens": lens,
        "max_abs_diff": max_diff,
        "argmax_agreement": agree / max(n, 1),
        "pytorch_test_acc": ref_correct / max(n, 1),  # next-token accuracy
        "artifact_test_acc": art_correct / max(n, 1),
    }


def _text_io(splits: Splits, context: int) -> dict[str, Any]:
    """The card's input/output for a text model (no pixels, no normalisation)."""
    vocab = (getattr(splits, "model_args", None) or {}).get("vocab_size")
    return {
        "input": {
            "name": "input",
            "shape": ["batch", "seq"],
            "dtype": "int64",
            "layout": f"token ids, seq from 1 to {context}",
        },
        "normalisation": None,
        "output": {"name": "logits", "shape": ["batch", "seq", vocab]},
        "classes": vocab,
    }


def _session(path: Path):
    ort = _onnx_modules()
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: not ORT's per-node warnings
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@torch.no_grad()
def _compare(model: nn.Module, run, batches) -> dict[str, Any]:
    """Artifact vs PyTorch on the same batches: max abs diff, argmax agreement, accuracies."""
    max_diff, agree, ref_correct, art_correct, n = 0.0, 0, 0, 0, 0
    for x, labels in batches:
        ref = model(x).float().numpy()
        out = np.asarray(run(x.numpy()), dtype=np.float32)
        max_diff = max(max_diff, float(np.abs(out - ref).max()))
        a, b, y = ref.argmax(1), out.argmax(1), labels.numpy()
        agree += int((a == b).sum())
        ref_correct += int((a == y).sum())
        art_correct += int((b == y).sum())
        n += len(y)
    return {
        "samples": n,
        "max_abs_diff": max_diff,
        "argmax_agreement": agree / max(n, 1),
        "pytorch_test_acc": ref_correct / max(n, 1),
        "artifact_test_acc": art_correct / max(n, 1),
    }


# ---- int8: ONNX Runtime static quantization --------------------------------------------------


def _int8(ecfg, cfg, splits, transform, fp32_path: Path, fp32_card, model, test):
    """Calibrate on validation batches, quantize the fp32 ONNX file, verify, card it."""
    _onnx_modules()
    calib = _batches(splits.val, cfg, splits, transform, 0)[: ecfg.calib_batches]
    out = fp32_path.with_name(fp32_path.name.removesuffix(".onnx") + ".int8.onnx")
    t0 = time.perf_counter()
    _quantize_static(fp32_path, out, calib)
    quantize_s = time.perf_counter() - t0
    session = _session(out)
    name = session.get_inputs()[0].name
    check = _compare(model, lambda x: session.run(None, {name: x})[0], test)
    before, after = check["pytorch_test_acc"], check["artifact_test_acc"]
    log.info(
        "int8 -> %s (%s, fp32 %s): test acc %.4f -> %.4f (%+.4f) on %d samples; argmax "
        "agreement with fp32 %.4f%%, max abs diff %.3g; calibrated on %d validation batches",
        out,
        _size(out.stat().st_size),
        _size(fp32_path.stat().st_size),
        before,
        after,
        after - before,
        check["samples"],
        100 * check["argmax_agreement"],
        check["max_abs_diff"],
        len(calib),
    )
    card = {
        **fp32_card,
        "artifact": str(out),
        "file_bytes": out.stat().st_size,
        "export_s": fp32_card["export_s"] + quantize_s,
        "verification": {**check, "consumer": "onnxruntime.InferenceSession (CPU)"},
        "quantization": {
            "method": "onnxruntime.quantization.quantize_static (QDQ)",
            "weights": "int8 symmetric, per output channel",
            "activations": "uint8 asymmetric, per tensor, static (MinMax calibration)",
            "calibration": f"{len(calib)} validation batches ({sum(len(b[0]) for b in calib)} "
            "samples)",
            "fp32_artifact": str(fp32_path),
            "test_acc_before": before,
            "test_acc_after": after,
        },
    }
    _write_card(card, out)
    return card


def _quantize_static(fp32_path: Path, out: Path, calib: list) -> None:
    """ONNX Runtime's static quantization of `fp32_path` into `out` (QDQ, per-channel int8
    weights, uint8 activations), calibrated with MinMax on the `calib` batches."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quant_pre_process,
        quantize_static,
    )

    input_name = _session(fp32_path).get_inputs()[0].name

    class ValBatches(CalibrationDataReader):
        def __init__(self):
            self.batches = iter(calib)

        def get_next(self):
            batch = next(self.batches, None)
            return None if batch is None else {input_name: batch[0].numpy()}

    pre = out.with_name(f".{out.name}.pre.onnx")
    try:
        # Shape inference and graph clean-up first, as ONNX Runtime recommends for QDQ.
        quant_pre_process(str(fp32_path), str(pre), skip_symbolic_shape=True)
        quantize_static(
            str(pre),
            str(out),
            ValBatches(),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
        )
    finally:
        pre.unlink(missing_ok=True)


# ---- the card --------------------------------------------------------------------------------


def _card(ecfg, cfg, ckpt_path, state, splits, artifact, fmt, params, sparsity, check, export_s):
    run_dir = ckpt_path.parent.parent if ckpt_path.parent.name == "checkpoints" else None
    summary = _read_summary(run_dir)
    consumer = {
        "torch_export": "torch.export.load(path).module()",
        "onnx": "onnxruntime.InferenceSession (CPU)",
        "torchscript": "torch.jit.load(path)",
    }[fmt]
    config_file = run_dir / "config.yaml" if run_dir else None
    return {
        "artifact": str(artifact),
        "format": fmt,
        "file_bytes": artifact.stat().st_size,
        "export_s": export_s,
        "input": {
            "name": "input",
            "shape": ["batch", splits.in_channels, splits.image_size, splits.image_size],
            "dtype": "float32",
            "layout": "NCHW, contiguous",
        },
        "normalisation": {
            "formula": "x = (uint8_pixels / 255 - mean) / std, per channel",
            "mean": list(cfg.dataset.mean),
            "std": list(cfg.dataset.std),
        }
        if "mean" in cfg.dataset
        else None,
        "output": {"name": "logits", "shape": ["batch", splits.num_classes]},
        "classes": splits.num_classes,
        "dataset": cfg.dataset.get("name", "custom"),
        "model": {"_target_": cfg.model._target_, "parameters": params},
        "accuracy_in_run_summary": {
            k: summary[k] for k in ("test_acc", "best_val_acc", "test_ckpt") if k in summary
        },
        "sparsity": sparsity,
        "quantization": None,
        "verification": {**check, "consumer": consumer},
        "source": {
            "checkpoint": str(ckpt_path),
            "checkpoint_sha256": _sha256(ckpt_path),
            "config": str(config_file) if config_file and config_file.is_file() else None,
            "step": state["progress"]["step"],
            "epoch": state["progress"]["epoch"],
        },
        "versions": {"torch": torch.__version__},
    }


def _read_summary(run_dir: Path | None) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "summary.json").read_text()) if run_dir else {}
    except (OSError, ValueError):
        return {}  # no summary (a run that stopped early): the card says nothing about it


def _sha256(path: Path) -> str:
    """Of the file, or of a .dcp directory's files in name order."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        with open(file, "rb") as f:
            for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _write_card(card: dict[str, Any], artifact: Path) -> Path:
    path = artifact.with_name(artifact.name + ".json")
    path.write_text(json.dumps(json_safe(card), indent=2, allow_nan=False) + "\n")
    return path


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
