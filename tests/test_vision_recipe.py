"""The recipe switches of issue 38 (docs/vision.md "Recipe switches"): each against timm's own
function on the same seed (mixup/cutmix: timm.data.Mixup under the same numpy seed, the same
lambdas and boxes; RandAugment: the transform timm's create_transform builds, under the same
random/numpy seed; random erasing: timm's RandomErasing, the same boxes and noise; progressive
resizing: FFCV's get_resolution), none moving a global random stream; layer-wise lr decay:
timm's create_optimizer_v2 groups; soft targets: timm's SoftTargetCrossEntropy. One real-CLI
run with every switch on, stopped mid-epoch and resumed, against an uninterrupted run."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import assert_same_weights, check_ok, read_jsonl
from omegaconf import OmegaConf

from accel_train.checkpoint import load_checkpoint
from accel_train.config.checks import validate
from accel_train.config.recipe_checks import check_recipe
from accel_train.data.crops import RandomResizedCrop
from accel_train.data.images.batch_mix import _ERASE, _MIX, build_batch_mix
from accel_train.data.images.folder import build_image_folder
from accel_train.data.images.sample_recipe import AutoAugment, ProgressiveSizes, auto_augment
from accel_train.data.seeded import derive_seed
from accel_train.errors import UserError
from accel_train.optim import build_optimizer, build_scheduler
from accel_train.tasks.classification import Classification

MEAN = (0.485, 0.456, 0.406)
# (dataset.cache=ram decodes base images with torchvision, which deprecates its decoders)
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


def dataset_cfg(**switches) -> OmegaConf:
    base = dict(
        random_erasing=0.0, random_erasing_mode="pixel", random_erasing_count=1,
        mixup_alpha=0.0, cutmix_alpha=0.0, mixup_prob=1.0, mixup_switch_prob=0.5,
        mixup_mode="batch",
    )  # fmt: skip
    return OmegaConf.create({**base, **switches})


def rng_states():
    return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()


def assert_unmoved(before) -> None:
    """No global random stream moved since ``before`` (rng_states())."""
    now = rng_states()
    assert now[:2] == before[:2] and torch.equal(now[2], before[2])


# ---- mixup / cutmix / random erasing: timm's objects on the same seed ---------------------


@pytest.mark.parametrize(
    "switches",
    [
        {"mixup_alpha": 0.8},
        {"cutmix_alpha": 1.0},
        {"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "mixup_switch_prob": 0.5},
        {"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "mixup_mode": "elem", "mixup_prob": 0.6},
    ],
    ids=str,
)
def test_mixup_and_cutmix_are_timms_on_the_same_numpy_seed(switches):
    from timm.data import Mixup

    ds = dataset_cfg(**switches)
    mix = build_batch_mix(ds, 5, 0.1, seed=3, rank=1, device=torch.device("cpu"))
    x, labels = torch.randn(6, 3, 16, 16), torch.tensor([0, 1, 2, 3, 4, 0])
    before = rng_states()
    for epoch, batch in ((0, 0), (0, 1), (2, 7)):
        ours, soft, hard = mix(x.clone(), labels, epoch, batch)
        ref = Mixup(
            mixup_alpha=ds.mixup_alpha, cutmix_alpha=ds.cutmix_alpha, prob=ds.mixup_prob,
            switch_prob=ds.mixup_switch_prob, mode=ds.mixup_mode, label_smoothing=0.1,
            num_classes=5,
        )  # fmt: skip
        saved = np.random.get_state()
        np.random.seed(derive_seed(3, epoch, batch, 1, _MIX))
        ref_x, ref_soft = ref(x.clone(), labels)
        np.random.set_state(saved)
        assert torch.equal(ours, ref_x) and torch.equal(soft, ref_soft)  # same lambda, boxes
        assert torch.equal(hard, labels) and not torch.equal(ours, x)
        assert torch.allclose(soft.sum(1), torch.ones(6))
    assert_unmoved(before)


def test_an_odd_batch_mixes_as_timm_would_without_its_assertion():
    from timm.data import Mixup

    mix = build_batch_mix(dataset_cfg(mixup_alpha=1.0), 3, 0.0, seed=0, rank=0, device="cpu")
    x, labels = torch.randn(5, 3, 8, 8), torch.tensor([0, 1, 2, 0, 1])
    ours, soft, _ = mix(x.clone(), labels, 0, 0)
    ref = Mixup(mixup_alpha=1.0, label_smoothing=0.0, num_classes=3)
    np.random.seed(derive_seed(0, 0, 0, 0, _MIX))
    lam = ref._mix_batch(ref_x := x.clone())
    assert torch.equal(ours, ref_x) and soft[0, 0] == pytest.approx(lam)


@pytest.mark.parametrize("mode, count", [("pixel", 1), ("rand", 3), ("const", 2)])
def test_random_erasing_is_timms_same_boxes_same_noise(mode, count):
    from timm.data.random_erasing import RandomErasing

    ds = dataset_cfg(random_erasing=0.7, random_erasing_mode=mode, random_erasing_count=count)
    erase = build_batch_mix(ds, 4, 0.0, seed=5, rank=0, device=torch.device("cpu"))
    x, labels = torch.randn(8, 3, 16, 16), torch.zeros(8, dtype=torch.long)
    before = rng_states()
    ours, same_labels = erase(x.clone(), labels, 1, 2)  # no mixing: (x, labels)
    assert_unmoved(before)
    seed = derive_seed(5, 1, 2, 0, _ERASE)
    random.seed(seed)
    torch.manual_seed(seed)
    ref = RandomErasing(0.7, mode=mode, max_count=count, device="cpu")(x.clone())
    assert torch.equal(ours, ref) and same_labels is labels
    assert 0 < (ours != x).any(1).flatten(1).any(1).sum() < 8  # some images erased, not all


# ---- auto_augment: timm's policies (and torchvision's TrivialAugmentWide) ----------------


def _image(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    img = torch.randint(0, 256, (3, 32, 32), generator=g, dtype=torch.uint8)
    img[:, 8:20, 4:28] = 200  # a shape, so geometric ops show
    return img


def test_rand_augment_is_the_transform_timms_factory_builds_on_the_same_seed():
    """Our policy against the secondary transform of timm's create_transform (its hparams:
    translate_const, img_mean, interpolation) under the same seeds, for 20 samples."""
    from PIL import Image
    from timm.data import create_transform

    spec = "rand-m9-mstd0.5-inc1"
    _, secondary, _ = create_transform(
        32, is_training=True, auto_augment=spec, interpolation="bilinear", mean=MEAN,
        separate=True,
    )  # fmt: skip
    ours = AutoAugment(spec, MEAN, "bilinear")
    changed = 0
    for i in range(20):
        img, draw = _image(i), random.Random(f"0/0/{i}")
        before = rng_states()
        out = ours(img, draw)
        assert_unmoved(before)
        seed = random.Random(f"0/0/{i}").getrandbits(32)
        random.seed(seed)
        np.random.seed(seed)
        ref = secondary(Image.fromarray(img.permute(1, 2, 0).numpy()))
        assert torch.equal(out, torch.from_numpy(np.array(ref)).permute(2, 0, 1)), i
        changed += not torch.equal(out, img)
    assert changed >= 10  # the ops ran (two, each with p=0.5: a quarter of samples unchanged)


def test_trivial_is_torchvisions_trivial_augment_wide_and_bad_specs_are_refused():
    from PIL import Image
    from torchvision.transforms import InterpolationMode, TrivialAugmentWide

    ours = AutoAugment("trivial", MEAN, "bilinear")
    fill = [round(255 * m) for m in MEAN]
    ref_tf = TrivialAugmentWide(interpolation=InterpolationMode.BILINEAR, fill=fill)
    for i in range(6):
        img = _image(i)
        out = ours(img, random.Random(i))
        torch.manual_seed(random.Random(i).getrandbits(32))
        ref = ref_tf(Image.fromarray(img.permute(1, 2, 0).numpy()))
        assert torch.equal(out, torch.from_numpy(np.array(ref)).permute(2, 0, 1))
    ds = OmegaConf.create({"mean": list(MEAN), "interpolation": "bilinear"})
    for bad in ("randaugment", "rand-q3", "augmix-q3"):
        with pytest.raises(UserError, match="dataset.auto_augment=.*e.g. `rand-m9"):
            auto_augment(bad, ds, 32)
    assert auto_augment("augmix-m5-w3", ds, 32)(_image(), random.Random(0)).shape == (3, 32, 32)


# ---- progressive resizing: FFCV's formula; the hooks of both image_folder paths ---------


def ffcv_get_resolution(epoch, min_res, max_res, end_ramp, start_ramp):
    """FFCV's examples/imagenet/train_imagenet.py ImageNetTrainer.get_resolution, verbatim."""
    assert min_res <= max_res
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    interp = np.interp([epoch], [start_ramp, end_ramp], [min_res, max_res])
    final_res = int(np.round(interp[0] / 32)) * 32
    return final_res


def test_progressive_sizes_are_ffcvs_schedule():
    # FFCV's rn50_88_epochs.yaml: min_res 160, max_res 192, start_ramp 65, end_ramp 76.
    ours = ProgressiveSizes(160, 192, 65, 76, 32)
    assert [ours(e) for e in range(88)] == [
        ffcv_get_resolution(e, 160, 192, 76, 65) for e in range(88)
    ]
    wide = ProgressiveSizes(128, 256, 2, 10, 32)
    assert [wide(e) for e in range(12)] == [
        ffcv_get_resolution(e, 128, 256, 10, 2) for e in range(12)
    ]
    assert {wide(e) for e in range(12)} == {128, 160, 192, 224, 256}


def _folder(root, n=4):
    from PIL import Image

    for c in range(2):
        (root / "train" / f"c{c}").mkdir(parents=True)
        for i in range(n):
            px = np.random.default_rng(c * 10 + i).integers(0, 256, (40 + 4 * i, 48, 3))
            Image.fromarray(px.astype(np.uint8)).save(root / "train" / f"c{c}" / f"{i}.jpg")
    return root


@pytest.mark.parametrize("cache", ["none", "ram"])
def test_each_epochs_size_and_augment_reach_the_samples_crops_from_the_whole_base(tmp_path, cache):
    """Both image_folder paths (photos; base images in a cache) take the hooks: the epoch's
    size, the crop drawn as without them (the same box, resized to that size), then the policy."""
    splits = build_image_folder(root=str(_folder(tmp_path)), image_size=16, cache=cache,
                                val_fraction=0.25, test_split=None)  # fmt: skip
    train = splits.train
    plain = [train.getitem(0, e)[0] for e in range(3)]
    train.size_at = ProgressiveSizes(16, 32, 0, 3, 16)
    sized = [train.getitem(0, e)[0] for e in range(3)]
    assert [s.shape[-1] for s in sized] == [16, 16, 32]  # 21.3 and 26.7 px rounded to 16
    assert torch.equal(sized[0], plain[0]) and torch.equal(sized[1], plain[1])
    if cache == "ram":  # the crop of the whole base at the epoch's size
        base = train.bases[int(train.indices[0])]
        crop = RandomResizedCrop(32, (0.08, 1.0), True)
        assert torch.equal(sized[2], crop(base, random.Random("0/2/0")))
    train.sample_augment = AutoAugment("rand-m9-n3", MEAN, "bilinear")
    augmented = train.getitem(0, 2)[0]
    assert augmented.shape == (3, 32, 32) and not torch.equal(augmented, sized[2])
    assert torch.equal(augmented, train.getitem(0, 2)[0])  # seeded by (seed, epoch, index)


# ---- layer decay: timm's groups; soft targets: timm's loss -------------------------------


def _opt_cfg(**kw):
    base = dict(name="adamw", lr=1e-3, weight_decay=0.05, fused=False, betas=[0.9, 0.999],
                eps=1e-8, layer_decay=0.65)  # fmt: skip
    return OmegaConf.create({**base, **kw})


def test_layer_decay_groups_are_timms_and_every_schedule_scales_each_group():
    import timm
    from timm.optim import create_optimizer_v2

    model = timm.create_model("test_vit", num_classes=4)
    model.patch_embed.requires_grad_(False)  # frozen (model.freeze, a LoRA base): left out
    ours = build_optimizer(model, _opt_cfg(), 1e-3, torch.device("cpu"))
    ref = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=0.65)

    def groups(opt):
        return sorted(
            (g["lr_scale"], g["weight_decay"], sorted(id(p) for p in g["params"]))
            for g in opt.param_groups
        )

    assert groups(ours) == groups(ref) and len(ours.param_groups) > 4
    assert all(g["lr"] == pytest.approx(1e-3 * g["lr_scale"]) for g in ours.param_groups)
    frozen = {id(p) for p in model.patch_embed.parameters()}
    assert not frozen & {id(p) for g in ours.param_groups for p in g["params"]}
    scales = torch.tensor([g["lr_scale"] for g in ours.param_groups])
    for sched in (
        {"name": "cosine", "warmup_steps": 2, "min_lr": 1e-4},
        {"name": "onecycle", "warmup_steps": 0, "max_lr": 0.01, "pct_start": 0.3},
        {"name": "step", "warmup_steps": 0, "step_size": 2, "gamma": 0.5},
    ):
        opt = build_optimizer(model, _opt_cfg(), 1e-3, torch.device("cpu"))
        schedule = build_scheduler(opt, OmegaConf.create(sched), 10)
        for _ in range(7):
            opt.step()
            schedule.step()
            lrs = torch.tensor([g["lr"] for g in opt.param_groups])
            assert torch.allclose(lrs / scales, lrs[-1:] / scales[-1:]), sched  # one curve x scale


def test_layer_decay_is_refused_for_a_model_without_layer_groups():
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    with pytest.raises(UserError, match=r"optimizer.layer_decay=0.65 needs .*group_matcher"):
        build_optimizer(mlp, _opt_cfg(), 1e-3, torch.device("cpu"))


def test_soft_targets_train_with_timms_soft_target_loss_and_hard_label_accuracy():
    from timm.loss import SoftTargetCrossEntropy

    task = Classification()
    task.loss_fn, task.num_classes, task.device = torch.nn.CrossEntropyLoss(), 4, "cpu"
    task.loss_cfg = OmegaConf.create({"_target_": "torch.nn.CrossEntropyLoss"})
    model = torch.nn.Linear(6, 4)
    x, labels = torch.randn(8, 6), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    soft = torch.softmax(torch.randn(8, 4), 1)
    loss = task.step(model, (x, soft, labels))
    assert torch.allclose(loss, SoftTargetCrossEntropy()(model(x), soft))
    correct = (model(x).argmax(1) == labels).sum()
    assert task.train_metrics.sums["acc"] == correct and task.train_metrics.counts["acc"] == 8
    task._check_soft_loss()  # torch's CrossEntropyLoss takes probabilities
    task.loss_fn = torch.nn.NLLLoss()  # class indices only
    with pytest.raises(UserError, match=r"soft targets .*loss._target_=torch.nn.CrossEntropyLoss"):
        task._check_soft_loss()


def test_the_config_refuses_what_cannot_work(compose_cfg, tmp_path):
    base = ["dataset=image_folder", "dataset.root=x", f"paths.output_dir={tmp_path}"]
    for overrides, match in (
        (["task=regression", "dataset.mixup_alpha=0.8"], "only task=classification"),
        (["dataset.mixup_alpha=0.8", "dataset.mixup_mode=pair", "loader.batch_size=7"],
         "every batch must be even"),
        (["dataset.random_erasing=1.5"], r"dataset.random_erasing=1.5 must be a probability"),
        (["dataset.random_erasing_mode=noise"], "one of pixel, rand, const"),
        (["optimizer=muon", "optimizer.layer_decay=0.7"], "Muon splits"),
        (["optimizer.layer_decay=1.5"], r"must be in \(0, 1\]"),
        (["trainer.progressive_resize={start_size:160,end_epoch:-1}"], "start_epoch <= end_epoch"),
        (["trainer.progressive_resize={size:160}"], "give a dict of start_size"),
    ):  # fmt: skip
        with pytest.raises(UserError, match=match):
            validate(compose_cfg([*base, *overrides]))
    gpu = compose_cfg([*base, "dataset.auto_augment=trivial", "dataset.decode=gpu"])
    with pytest.raises(UserError, match="decodes on the device, after the loader"):
        check_recipe(gpu)  # (validate refuses decode=gpu on a machine without CUDA first)
    validate(compose_cfg([*base, "trainer.progressive_resize={start_size:128,end_epoch:3}"]))


# ---- the real CLI: every switch on, stopped mid-epoch and resumed ------------------------

# 2 classes x 12 photos, 4 held out: 20 training images, batch 8 -> 3 batches (the last of 4,
# short) = 3 optimizer steps an epoch; the interrupted run checkpoints at step 4 (epoch 1,
# batch 1 of 3) and stops there. A step schedule, as tests/test_resume.py's: its first steps do
# not depend on the run's length, which the interrupted run's max_steps changes (a cosine would).


def _cli_args(root, run_dir):
    return [
        "dataset=image_folder", f"dataset.root={root}", "dataset.test_split=null",
        "dataset.val_fraction=0.2", "dataset.image_size=24",
        "model=timm", "model.name=test_efficientnet",
        "dataset.auto_augment=rand-m9-mstd0.5-inc1", "dataset.random_erasing=0.25",
        "dataset.mixup_alpha=0.8", "dataset.cutmix_alpha=1.0", "loss.label_smoothing=0.1",
        "trainer.progressive_resize={start_size:16,end_size:32,start_epoch:0,end_epoch:2,step:16}",
        "optimizer=adamw", "optimizer.layer_decay=0.7", "scheduler=step", "scheduler.step_size=3",
        "loader.batch_size=8", "loader.num_workers=1", "trainer.max_epochs=3",
        "trainer.log_every_n_steps=1", "trainer.deterministic=true", "trainer.progress=plain",
        "logger=none", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip


def test_every_switch_resumes_mid_epoch_exactly_and_reports_hard_label_accuracy(run_cli, tmp_path):
    root = _folder(tmp_path / "data", n=12)
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    full = run_cli(_cli_args(root, reference))
    check_ok(full)
    log = full.stdout + full.stderr
    for epoch, size in ((0, 16), (1, 32), (2, 32)):  # (epoch 1: 24 px, rounded as numpy does)
        assert f"progressive_resize: epoch {epoch} trains at {size} px" in log
    assert "label_smoothing=0.1 is folded into mixup/cutmix's soft targets" in log
    techniques = next(ln for ln in log.splitlines() if "techniques: " in ln)
    switches = ("progressive_resize", "auto_augment=rand-m9-mstd0.5-inc1", "random_erasing=0.25")
    for switch in (*switches, "mixup=0.8", "cutmix=1.0", "layer_decay=0.7"):
        assert switch in techniques, techniques
    # 24 px is none of the schedule's sizes: the log says the schedule wins (issue 47 A.8c)
    assert "the schedule sets the training size, not dataset.image_size=24" in log
    metrics = read_jsonl(reference / "metrics.jsonl")
    train_acc = [m["train/acc"] for m in metrics if "train/acc" in m]
    assert len(train_acc) == 9 and all(0 <= a <= 1 for a in train_acc)  # hard-label accuracy
    assert [m["val/acc"] for m in metrics if "val/acc" in m]

    first = _cli_args(root, resumed)
    check_ok(run_cli([*first, "trainer.max_steps=4", "trainer.ckpt_every_n_steps=4"]))
    progress = load_checkpoint(resumed / "checkpoints" / "last.pt")["progress"]
    assert (progress["epoch"], progress["step"], progress["batch_in_epoch"]) == (1, 4, 1)
    check_ok(run_cli([*first, "resume=auto"]))
    assert_same_weights(resumed / "checkpoints" / "last.pt", reference / "checkpoints" / "last.pt")
    losses = {m["step"]: m["train/loss"] for m in metrics if "train/loss" in m}
    again = {m["step"]: m["train/loss"] for m in read_jsonl(resumed / "metrics.jsonl")
             if "train/loss" in m and m["step"] > 4}  # fmt: skip
    assert again and all(again[s] == losses[s] for s in again)
