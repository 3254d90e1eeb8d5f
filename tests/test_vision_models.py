"""Models by name (model=timm, model=torchvision; docs/vision.md): the issue's done-when runs
shrunk to 32-pixel images and one step, a timm folder's weights loaded bit for bit with a fresh
head and kept by model.freeze, the model's pretrained data config in config.yaml, a timm folder
as a distillation teacher, torch.export of a timm checkpoint, and the refusals (an unknown name,
another architecture's weights) before anything is written. Plus the capabilities the
strategies and techniques ask of a timm model, in process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import check_ok
from omegaconf import OmegaConf

timm = pytest.importorskip("timm")

RUN = [
    "dataset=image_folder",
    "dataset.image_size=32",
    "loader.batch_size=6",
    "trainer.max_steps=1",
    "trainer.progress=none",
    "logger=none",
]


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """root/{train,val}/<class>/*.jpg: 3 classes x 8 training and 2 test 36x36 JPEGs."""
    from torchvision.io import encode_jpeg, write_file

    root = tmp_path_factory.mktemp("photos")
    gen = torch.Generator().manual_seed(0)
    for split, n in (("train", 8), ("val", 2)):
        for c in range(3):
            (root / split / f"c{c}").mkdir(parents=True)
            for k in range(n):
                img = torch.full((3, 36, 36), 40.0)
                img[c] = 200.0
                img += 20 * torch.randn(3, 36, 36, generator=gen)
                jpeg = encode_jpeg(img.clamp(0, 255).to(torch.uint8))
                write_file(str(root / split / f"c{c}" / f"{k}.jpg"), jpeg)
    return root


def save_timm(folder: Path, name: str, num_classes: int, **kwargs) -> Path:
    """A folder as timm writes it for the hub (config.json and the weights)."""
    from timm.models import save_for_hf

    model = timm.create_model(name, pretrained=False, num_classes=num_classes)
    save_for_hf(model, str(folder), **kwargs)
    return folder


def test_timm_models_by_name_train_with_switches(run_cli, photos, tmp_path):
    """The done-when's three timm models in one sweep (one process), each with channels_last,
    EMA, full activation checkpointing (timm's own for ConvNeXt and the ViT, which have no
    BatchNorm; the blocks wrapped for EfficientNet) and a timm keyword argument."""
    sweep = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            "model=timm",
            "model.name=convnext_atto,vit_tiny_patch16_224,efficientnet_b0",
            "+model.drop_path_rate=0.1",
            f"dataset.root={photos}",
            *RUN,
            "trainer.channels_last=true",
            "ema.enabled=true",
            "activation_checkpointing.mode=full",
            f"hydra.sweep.dir={sweep}",
        ],
        timeout=600,
    )
    check_ok(proc)
    out = proc.stdout + proc.stderr
    for job, name in enumerate(("convnext_atto", "vit_tiny_patch16_224", "efficientnet_b0")):
        summary = json.loads((sweep / str(job) / "summary.json").read_text())
        assert summary["steps"] == 1, summary
        cfg = OmegaConf.load(sweep / str(job) / "config.yaml")
        assert cfg.model.name == name and cfg.model.drop_path_rate == 0.1
    # The ViT's own normalisation (0.5) from timm's registry, written into its config.yaml.
    assert OmegaConf.load(sweep / "1" / "config.yaml").dataset.mean == [0.5, 0.5, 0.5]
    assert "model=timm vit_tiny_patch16_224: dataset.mean=[0.5, 0.5, 0.5]" in out
    assert out.count("activation checkpointing (full): the model's own (timm's)") == 2
    assert "activation checkpointing (full): 7 of 7 blocks (Sequential)" in out  # EfficientNet's


def test_torchvision_resnet50_trains(run_cli, photos, tmp_path):
    proc = run_cli(
        ["model=torchvision", "model.name=resnet50", f"dataset.root={photos}", *RUN,
         f"hydra.run.dir={tmp_path / 'run'}"],
    )  # fmt: skip
    check_ok(proc)
    cfg = OmegaConf.load(tmp_path / "run" / "config.yaml")
    if "crop_pct" in cfg.dataset:  # (a key of the image pipeline's: its weights' 224 of 232)
        assert cfg.dataset.crop_pct == pytest.approx(224 / 232, abs=1e-4)
    assert "model=torchvision resnet50: dataset.mean=[0.485, 0.456, 0.406]" in proc.stdout


def test_timm_folder_weights_freeze_distill_and_export(run_cli, photos, tmp_path):
    """model.weights=<timm folder> (the architecture from its config.json): every backbone tensor
    loaded bit for bit (frozen, so last.pt must still hold the file's), the 5-class head
    re-initialised for the data's 3 and its keys logged; its data config taken but the user's
    dataset.std kept; a 3-class timm folder distils into it; torch.export of the checkpoint."""
    student = save_timm(tmp_path / "student", "test_convnext", 5, safe_serialization=True)
    teacher = save_timm(tmp_path / "teacher", "test_convnext", 3)  # pytorch_model.bin only
    run = tmp_path / "run"
    proc = run_cli(
        [
            "model=timm",
            f"model.weights={student}",
            "model.freeze=[stem,stages,head.norm]",
            f"distill.teacher={teacher}",
            "dataset.std=[0.25,0.25,0.25]",
            f"dataset.root={photos}",
            *RUN,
            "trainer.max_steps=2",
            f"hydra.run.dir={run}",
        ]
    )
    check_ok(proc)
    out = proc.stdout + proc.stderr
    assert "keys skipped: head.fc.bias, head.fc.weight" in out
    assert "from model.weights' config.json (kept the run's own dataset.std)" in out
    assert f"distill: teacher {teacher} (timm test_convnext)" in out
    cfg = OmegaConf.load(run / "config.yaml")
    assert cfg.model.name == "test_convnext"
    assert (cfg.dataset.mean, cfg.dataset.std) == ([0.5] * 3, [0.25] * 3)

    from safetensors.torch import load_file

    original = load_file(student / "model.safetensors")
    trained = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["model"]
    body = [k for k in original if not k.startswith("head.fc.")]
    assert len(body) > 20 and all(torch.equal(trained[k], original[k]) for k in body)
    assert trained["head.fc.weight"].shape == (3, 64) != original["head.fc.weight"].shape

    exported = run_cli(
        [f"ckpt_path={run / 'checkpoints' / 'last.pt'}", "format=torch_export"],
        prog="accel-export",
    )
    check_ok(exported)
    assert (run / "checkpoints" / "last.pt2").is_file()


@pytest.mark.parametrize(
    "case, expect",
    [
        ("other_architecture", ["resnet10t", "conv1.0.weight", "model.name=resnet10t"]),
        ("unknown_timm", ["model.name=convnext_atoo", "convnext_atto"]),
    ],
)
def test_refused_before_anything_is_written(case, expect, run_cli, photos, tmp_path):
    args = {
        "other_architecture": ["model=timm", "model.name=test_convnext"],
        "unknown_timm": ["model=timm", "model.name=convnext_atoo"],
    }[case]
    if case == "other_architecture":
        args.append(f"model.weights={save_timm(tmp_path / 'rn', 'resnet10t', 3)}")
    run = tmp_path / "run"
    proc = run_cli([*args, f"dataset.root={photos}", *RUN, f"hydra.run.dir={run}"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    error = " ".join(proc.stderr.split())
    assert all(e in error for e in expect), error
    assert not run.exists()


# ---- in process -----------------------------------------------------------------------------


def test_torchvision_names_are_checked_like_timms():
    """(The same launch-time step as model=timm's refusal above, without the subprocess.)"""
    from accel_train.errors import UserError
    from accel_train.models.torchvision import check_name

    with pytest.raises(UserError, match=r"model.name=resnet5: .* The closest: resnet50"):
        check_name("resnet5")
    with pytest.raises(UserError, match="not a classifier .*detection"):
        check_name("fasterrcnn_resnet50_fpn")


def test_what_a_timm_model_tells_the_strategies_and_techniques(tmp_path):
    from accel_train.models import build_model
    from accel_train.models.weights import load_weights
    from accel_train.strategies.fsdp import shard_units
    from accel_train.techniques.activation_checkpointing import find_blocks, own_checkpointing

    data = {"in_channels": 1, "image_size": 32, "num_classes": 3}

    def build(name, **kwargs):
        node = {"_target_": "accel_train.models.timm.timm_model", "name": name, **kwargs}
        return build_model(OmegaConf.create(node), data)

    vit = build("test_vit", drop_path_rate=0.1)  # timm's own keyword, through build_model
    assert vit.blocks[1].drop_path1.drop_prob > 0  # (a DropPath only when the rate is > 0)
    assert vit.patch_embed.proj.in_channels == 1 and vit(torch.zeros(2, 1, 32, 32)).shape == (2, 3)
    assert shard_units(vit, []) == list(vit.blocks)
    assert own_checkpointing(vit)
    # ImageNet-style weights (3 channels) on grayscale data: the stem converted as timm does.
    rgb = timm.create_model("test_vit", num_classes=3, img_size=32).state_dict()
    torch.save(rgb, tmp_path / "rgb.pth")
    load_weights(vit, str(tmp_path / "rgb.pth"))
    assert torch.allclose(vit.patch_embed.proj.weight, rgb["patch_embed.proj.weight"].sum(1, True))
    assert torch.equal(vit.blocks[0].attn.qkv.weight, rgb["blocks.0.attn.qkv.weight"])
    net = build("test_efficientnet")
    assert shard_units(net, []) == list(net.blocks)  # its stages, not the whole body
    assert not own_checkpointing(net)  # BatchNorm: accel-train wraps the same stages itself
    assert [block for _, _, block in find_blocks(net, [])] == list(net.blocks)


def test_a_pretrained_data_config_keeps_what_an_experiment_set(compose_cfg):
    """A dataset key that an experiment (or any added config) set differs from the dataset
    option's own file: it stays; the keys the option file gives are replaced by the model's."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from accel_train.config import CONFIG_DIR
    from accel_train.models.data_config import apply_data_config

    compose_cfg()  # the schemas and resolvers registered
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        cfg = compose("train", ["dataset=image_folder", "dataset.root=x"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    cfg.dataset.std = [0.3, 0.3, 0.3]  # as an experiment's `dataset: {std: ...}` would
    pretrained = {"mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25), "crop_pct": 0.9}
    try:
        apply_data_config(cfg, pretrained, "model=timm x", "from its pretrained config")
    finally:
        HydraConfig.instance().cfg = None  # the next tests of this process run outside Hydra
    assert cfg.dataset.mean == [0.5, 0.5, 0.5] and cfg.dataset.std == [0.3, 0.3, 0.3]


def test_the_two_vision_recipes_run_shrunk(run_cli, photos, tmp_path):
    """+experiment=imagenet_resnet50 (FFCV's recipe: OneCycle linear, progressive resizing, its
    crop ratio kept over torchvision's data config) and +experiment=vit_finetune (a timm folder's
    weights, layer decay, mixup/cutmix, RandAugment, erasing, EMA) at 32 px, a few steps each,
    as one sweep per recipe would be two processes: the recipes differ in their groups."""
    vit = save_timm(tmp_path / "vit", "test_vit", 5)
    shrink = [f"dataset.root={photos}", "loader.batch_size=4", "loader.num_workers=0"]
    shrink += ["trainer.progress=none", "logger=none", "dataset.val_fraction=0.25"]
    runs = {
        "rn50": [
            "+experiment=imagenet_resnet50",
            "model.name=resnet18",  # the same builder, a quarter of the compute
            "dataset.image_size=32",
            "dataset.eval_image_size=32",
            "trainer.max_epochs=2",
            "trainer.progressive_resize.start_size=32",
            "trainer.progressive_resize.end_size=64",
            "trainer.progressive_resize.start_epoch=0",
            "trainer.progressive_resize.end_epoch=1",
        ],
        "vit": [
            "+experiment=vit_finetune",
            f"model.weights={vit}",
            "+model.drop_path_rate=0.1",
            "dataset.image_size=32",
            "scheduler.warmup_steps=2",
            "trainer.max_steps=4",
        ],
    }
    for name, overrides in runs.items():
        run = tmp_path / name
        proc = run_cli([*overrides, *shrink, f"hydra.run.dir={run}"])
        check_ok(proc)
        assert json.loads((run / "summary.json").read_text())["steps"] > 0
        cfg = OmegaConf.load(run / "config.yaml")
        out = proc.stdout + proc.stderr
        if name == "rn50":
            # The recipe's crop ratio (FFCV's 224/256) stays; torchvision's mean/std are taken.
            assert cfg.dataset.crop_pct == 0.875 and cfg.scheduler.anneal_strategy == "linear"
            assert "kept the run's own dataset.crop_pct" in out and "64" in out
        else:
            assert cfg.model.name == "test_vit" and cfg.optimizer.layer_decay == 0.65
            assert cfg.ema.enabled and cfg.dataset.mixup_alpha == 0.8
            # test_vit's 160-px table (10 x 10 + 1) for 32 px (2 x 2 + 1), as timm resamples.
            assert "pos_embed resampled from 101 to 5 positions" in out


def test_pretrained_true_is_refused_for_it_would_download():
    from accel_train.errors import UserError
    from accel_train.models.timm import timm_model
    from accel_train.models.torchvision import torchvision_model

    for build in (timm_model, torchvision_model):
        name = "test_vit" if build is timm_model else "resnet18"
        with pytest.raises(UserError, match="never downloads: give them as a local"):
            build(name=name, num_classes=2, pretrained=True)
