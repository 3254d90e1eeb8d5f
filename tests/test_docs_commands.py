"""Every `accel-*` command a reader would copy from README.md and docs/**/*.md runs (issue 19):
a renamed key, group or option breaks this test, not a reader.

Cheaply: `accel-train` and `accel-report` lines run in one process up to where training would
start (tests/doc_dry_run.py: compose, validate, resolve and every launch-time check; a sweep's
jobs too); the training lines of REAL_DOCS (the README, vision, fine-tuning, long-context and
architecture pages) train for real there, one batch of each split, shrunk only by what is
appended (`shrink`: `+debug=fast_dev_run`, a 1-layer GPT, 64-token rows, 2 processes where a
line asks for more; doc_dry_run.py's SHRINK: the images, batches and loader workers), so a
command that cannot start fails (issue 47: the model, the data and the techniques are built).
A sweep's jobs train so too; a line of several processes starts them (torchrun, gloo); a
multi-node, SLURM or Ray line stops where it would wait for other nodes or submit;
`accel-eval`, `accel-export`, `accel-sample` and `accel-data` run for real on tiny
fixtures (a one-epoch run, a two-step GPT, a token folder from a short text), with tiny
overrides appended where the command would take long. Placeholders (`<run>`, `...`, `/data`,
`../shared/data`) become those fixtures. A code block marked `<!-- needs: REASON -->` on the line
before it (a GPU, a cluster, a network) is skipped with that reason.

Why not `accel-train ... --cfg job`: Hydra prints the composed config and exits before the task
function, so the schema's types are checked but none of accel-train's own checks run
(`loader.batch_size=0` passes). The dry run is about as cheap and runs them all; two canaries
(a misspelled key, an impossible value) check that it refuses what it should.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from doc_commands import DocCommand, all_commands
from grpo_fixtures import docs_reward_module, user_code, write_question_prompts
from helpers import check_ok, run_cli
from hf_fixtures import write_gpt2_tokens, write_preferences, write_records, write_tiny_llama
from test_image_folder import write_image_folder

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = all_commands()
DRY = ("accel-train", "accel-report")
RUN = "RUN"  # what `<run>` becomes: a run dir of the fixtures

TEXT = "def main():\n    print('hello, world')\n\n" * 400

# accel-train arguments appended to every dry command: none; and per program, for real runs.
APPENDED = {
    "accel-export": ["verify_samples=64", "calib_batches=2"],
    "accel-sample": ["max_new_tokens=20", "num_samples=1"],
    "accel-data": ["overwrite=true"],
}


# The pages whose training commands run for real (see the module docstring): ~1 CPU s a line
# in one process, 11-21 CPU s a line of 2 processes; the other pages' lines stop where
# training would start.
REAL_DOCS = (
    "README.md",
    "docs/vision.md",
    "docs/fine-tuning.md",
    "docs/long-context.md",
    "docs/architecture.md",
    "docs/video.md",
)
GPT_RECIPES = ("gpt_char", "gpt_char_fast", "gpt2_small", "gpt2_long")
GRPO_RECIPES = ("grpo_lora",)


def shrink(argv: list[str]) -> list[str]:
    """What a reader appends to try a real command on a laptop (appended overrides win): one
    batch of each split, a 1-layer GPT of width 32 (its context 64 where the command sets no
    `dataset.max_length`), rows of 64 tokens for a Hugging Face model (for GRPO, 2 completions
    of 8 tokens a prompt), 2 processes at most.
    doc_dry_run.py's SHRINK shrinks images, batches and loader workers alike."""
    given = {a.split("=", 1)[0].lstrip("+") for a in argv if "=" in a}
    values = dict(a.lstrip("+").split("=", 1) for a in argv if "=" in a)
    out = ["+debug=fast_dev_run", "trainer.progress=none", "logger=none"]
    grpo = values.get("experiment") in GRPO_RECIPES or values.get("task") == "grpo"
    if grpo or values.get("dataset") == "prompts":  # (prompts have no dataset.max_length)
        out += ["task.num_generations=2", "task.max_completion_length=8"]
    elif values.get("experiment") in GPT_RECIPES or values.get("model") == "gpt":
        out += ["model.n_layer=1", "model.n_embd=32", "model.n_head=2"]
        if "dataset.max_length" not in given:
            out.append("model.block_size=64")
    elif "model.path" in given and "dataset.max_length" not in given:
        out.append("dataset.max_length=64")
    if int(values.get("launcher.nproc_per_node", "1")) > 2:
        out.append("launcher.nproc_per_node=2")
    return out


def trains_for_real(command: DocCommand) -> bool:
    argv = command.argv
    return (
        command.program == "accel-train"
        and command.source.split(":")[0] in REAL_DOCS
        and not {"--help", "--cfg"} & set(argv)
        and not any(a.startswith(("resume=", "+debug=")) for a in argv)
    )


# Commands the dry run must refuse (exit 2): a key the schema does not have, a value a check
# refuses. If these passed, the docs' commands passing would prove nothing.
CANARIES = [
    DocCommand("canary:unknown-key", "accel-train trainer.max_epoch=3", None),
    DocCommand("canary:bad-value", "accel-train loader.batch_size=0", None),
    # Refused by the launcher's own launch (its strategy check), after every config check.
    DocCommand(
        "canary:slurm-strategy",
        "accel-train launcher=slurm launcher.nodes=2 launcher.gpus_per_node=8 strategy=single",
        None,
    ),
    DocCommand(
        "canary:kubernetes-strategy",
        "accel-train launcher=kubernetes launcher.image=registry/accel:1.0 launcher.nodes=2 "
        "launcher.volume=runs-pvc hydra.run.dir=/runs/exp1 strategy=single",
        None,
    ),
]


def _ids(commands: list[DocCommand]) -> list[str]:
    seen: dict[str, int] = {}
    ids = []
    for c in commands:
        base = f"{c.source}:{c.program}"
        seen[base] = seen.get(base, 0) + 1
        ids.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return ids


def substitute(command: DocCommand, mnist_dir: Path) -> list[str]:
    """The command's argv with its placeholders pointing at the fixtures."""
    text = command.text.replace("<run>", RUN)
    text = re.sub(r"ckpt_path=\.\.\.", "ckpt_path=outputs/my_run/checkpoints/best.pt", text)
    for data in ("../shared/data", "/path/to/data", "/elsewhere"):
        text = text.replace(data, str(mnist_dir))
    text = text.replace("/tmp/bench/readme_run/run", "outputs/readme_run")
    # GPT-2 tokens (README.md, docs/long-context.md): not the folder language-models.md writes
    text = text.replace("dataset.path=data/mytokens", "dataset.path=data/gpt2-tokens")
    # docs/streaming.md: a tiny JPEG folder of the workspace, and shards beside it.
    text = text.replace("/data/imagenette2-160", "imagenette2-160")
    text = text.replace("/mnt/shards/", "shards/")
    # docs/fine-tuning.md: the tiny Llama folder, its records and a JPEG folder for the pets.
    for folder in ("/models/qwen2.5-0.5b", "/models/llama-3.2-1b", "/models/my-sft"):
        text = text.replace(folder, "models/tiny-llama")
    # (one export folder per command: an export never writes over an existing folder)
    where = re.sub(r"\W", "_", command.source)
    text = text.replace("/models/my-finetune", f"models/my-finetune-{where}")
    text = text.replace("/models/my-grpo", f"models/my-grpo-{where}")
    text = text.replace("/models/resnet18.pth", "models/resnet18.pth")
    text = text.replace("/models/convnext_atto.d2_in1k", "models/convnext_atto.d2_in1k")
    text = text.replace("/models/vit_small_patch16_224", "models/vit_small_patch16_224")
    text = text.replace("/data/imagenet", "imagenet")  # (1 % of train/ holds out a few)
    text = text.replace("/data/pets", "imagenette2-160")
    text = text.replace("dataset.root=DIR", "dataset.root=imagenette2-160")
    # docs/video.md: moving-square videos (tests/test_video.py) and a Kinetics-like tree
    for data in ("/data/videos", "/data/kinetics400"):
        text = text.replace(data, data.removeprefix("/data/"))
    argv = [a for a in shlex.split(text) if a != "..."]
    if any(a.startswith("hparams_search=") for a in argv):
        argv.append("hydra.sweeper.n_trials=2")  # checks the same as 20 or 50 trials
    if trains_for_real(command):
        argv += shrink(argv)
    return argv + APPENDED.get(argv[0], [])


MY_PROJECT = {
    "nets.py": """
import torch
from torch import nn


class WideCNN(nn.Module):
    def __init__(self, width, in_channels, num_classes):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, width, 3, padding=1)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).mean(dim=(2, 3)))
""",
    "data.py": """
import torch
from torch.utils.data import TensorDataset


def build_sets(seed=0):
    gen = torch.Generator().manual_seed(seed)
    def split(n):
        return TensorDataset(torch.rand(n, 1, 8, 8, generator=gen), torch.arange(n) % 4)
    return split(32), split(8), split(8)
""",
    "steps.py": """
import torch
import torch.nn.functional as F


def step(model, batch):
    x, y = batch  # (the images as the data set holds them: uint8 for the built-in digits)
    x = x.float() / 255 if x.dtype == torch.uint8 else x
    logits = model(x)
    mae = (logits.argmax(1) - y).abs().float().mean()
    return F.cross_entropy(logits, y), {"mae": mae}
""",
}


def _write_user_code(root: Path) -> None:
    """The user's project the docs' examples name (`my_project`, `my_pkg`, `my_configs`)."""
    (root / "my_project").mkdir()
    (root / "my_project" / "__init__.py").write_text("")
    for name, source in MY_PROJECT.items():
        (root / "my_project" / name).write_text(source.lstrip())
    (root / "my_configs" / "model").mkdir(parents=True)
    (root / "my_configs" / "experiment").mkdir(parents=True)
    (root / "my_configs" / "model" / "my_net.yaml").write_text(
        "defaults: [mlp_schema, _self_]\n_target_: accel_train.models.mlp\nname: my_net\n"
    )
    (root / "my_configs" / "experiment" / "my_exp.yaml").write_text(
        "# @package _global_\ntrainer:\n  max_epochs: 2\n"
    )


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, mnist_dir) -> Path:
    """The directory every command runs in, with the fixtures its placeholders name: a finished
    one-epoch run (outputs/my_run, also RUN and outputs/{mnist_amp,train}/RUN), a token folder
    (data/mytext), a two-step GPT run on it (outputs/gpt_char/RUN), JPEG folders
    (imagenette2-160; imagenet, whose 1 % hold-out is not empty), a tiny Llama and its records,
    timm and torchvision weights, MNIST in ./data and GPT-2 tokens (data/mytokens)."""
    root = tmp_path_factory.mktemp("docs-commands")
    _write_user_code(root)
    (root / "input.txt").write_text(TEXT)
    write_image_folder(root / "imagenette2-160", n_train=10, n_val=2)
    write_image_folder(root / "imagenet", n_train=70, n_val=2)
    check_ok(run_cli(["tokenize", "input=input.txt", "out=data/mytext"], root, prog="accel-data"))
    fast = ["trainer.progress=none", "logger=none"]
    # The default config, one epoch: the docs' resume commands continue it unchanged.
    check_ok(run_cli(["hydra.run.dir=outputs/my_run", "trainer.max_epochs=1", *fast], root))
    gpt = ["+experiment=gpt_char", "dataset.path=data/mytext", "trainer.max_steps=2"]
    gpt += ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "dataset.eval_windows=4"]
    gpt += [
        "scheduler.warmup_steps=0",
        "trainer.log_every_n_steps=1",
        "trainer.val_check_interval=2",
    ]
    check_ok(run_cli([*gpt, f"hydra.run.dir=outputs/gpt_char/{RUN}", *fast], root))
    # Fine-tuning: a tiny Llama folder and records (docs/fine-tuning.md), a two-step sft_lora run.
    write_tiny_llama(root / "models" / "tiny-llama")
    write_records(root / "data" / "chat.jsonl", 16)
    write_records(root / "data" / "chat_val.jsonl", 4)
    write_records(root / "data" / "chat_test.jsonl", 4)  # (accel-eval data_path=)
    write_preferences(root / "data" / "prefs.jsonl", 8)  # (docs/fine-tuning.md's preference pairs)
    write_preferences(root / "data" / "prefs_val.jsonl", 4, start=8)
    # GRPO: prompts with an answer, and the page's own my/rewards.py (its reward function)
    write_question_prompts(root / "data" / "prompts.jsonl", 16)
    user_code(root, {"my/rewards.py": docs_reward_module()})
    sft = ["+experiment=sft_lora", "model.path=models/tiny-llama", "dataset.path=data/chat.jsonl"]
    sft += [
        "dataset.val_path=data/chat_val.jsonl",
        f"dataset.test_path={root / 'data/chat_val.jsonl'}",
    ]
    sft += ["dataset.max_length=64", "trainer.max_steps=2", "scheduler.warmup_steps=0"]
    check_ok(run_cli([*sft, f"hydra.run.dir=outputs/sft_lora/{RUN}", *fast], root))
    grpo = [
        "+experiment=grpo_lora",
        "model.path=models/tiny-llama",
        "dataset.path=data/prompts.jsonl",
    ]
    grpo += ["task.rewards=[{_target_: my.rewards.correct}]", "task.num_generations=2"]
    grpo += ["task.max_completion_length=8", "trainer.max_steps=2"]
    check_ok(run_cli([*grpo, f"hydra.run.dir=outputs/grpo_lora/{RUN}", *fast], root))
    (root / RUN).symlink_to(root / "outputs" / "my_run")
    # docs/vision.md: a folder as timm saves a model for the hub (the launch step reads it).
    from timm import create_model
    from timm.models import save_for_hf

    folder = root / "models" / "convnext_atto.d2_in1k"
    save_for_hf(create_model("convnext_atto", num_classes=1000), folder, safe_serialization=True)
    # (+experiment=vit_finetune's folder: timm's tiny test ViT stands in for a ViT-S)
    folder = root / "models" / "vit_small_patch16_224"
    save_for_hf(create_model("test_vit", num_classes=1000), folder, safe_serialization=True)
    # README.md: torchvision's ResNet-18 weights as a file, MNIST as downloaded into ./data,
    # GPT-2 tokens (docs/long-context.md).
    import torch
    from torchvision.models import resnet18

    torch.save(resnet18().state_dict(), root / "models" / "resnet18.pth")
    (root / "data" / "MNIST").symlink_to(mnist_dir / "MNIST")
    write_gpt2_tokens(root / "data" / "gpt2-tokens")  # (data/mytokens: language-models.md's)
    for name in ("mnist_amp", "train"):
        (root / "outputs" / name).mkdir(parents=True, exist_ok=True)
        (root / "outputs" / name / RUN).symlink_to(root / "outputs" / "my_run")
    _write_videos(root)
    return root


def _write_videos(root: Path) -> None:
    """docs/video.md's data: videos/ (4 training videos a class, 1 for val and test, and the
    same as CSV lists) and kinetics400/ (61 a class: its recipe's 1 % hold-out is not empty),
    32 frames at 15 fps (a default clip of 16 frames at stride 2 spans 31)."""
    from test_video import DIRECTIONS, write_video  # (PyAV: the video extra)

    n = 0
    for name, counts in (("videos", (4, 1, 1)), ("kinetics400", (61, 1, 0))):
        for split, count in zip(("train", "val", "test"), counts, strict=True):
            rows = ["path,label"]
            for d in DIRECTIONS:
                (root / name / split / d).mkdir(parents=True, exist_ok=True)
                for i in range(count):
                    write_video(root / name / split / d / f"{i:03d}.mp4", d, seed=n, frames=32)
                    rows.append(f"{split}/{d}/{i:03d}.mp4,{d}")
                    n += 1
            (root / name / f"{split}.csv").write_text("\n".join(rows) + "\n")


def made_first(command: DocCommand) -> bool:
    """An accel-data line of a page whose training lines train for real: it writes what they
    read (fine-tuning.md's shards), so it runs before them (`data_results`)."""
    return command.program == "accel-data" and command.source.split(":")[0] in REAL_DOCS


@pytest.fixture(scope="module")
def data_results(workspace, mnist_dir) -> dict[str, subprocess.CompletedProcess]:
    """The accel-data lines of REAL_DOCS, run (once) before their training lines."""
    done = {}
    for command in filter(made_first, COMMANDS):
        argv = substitute(command, mnist_dir)
        env = {"PYTHONPATH": user_path(workspace)}
        done[command.source] = run_cli(argv[1:], workspace, prog=argv[0], timeout=300, env=env)
    return done


@pytest.fixture(scope="module")
def dry_results(workspace, mnist_dir, tmp_path_factory, data_results) -> dict[str, dict]:
    """The exit status and output of every accel-train / accel-report command, run in one
    process (tests/doc_dry_run.py)."""
    todo = [c for c in COMMANDS if c.program in DRY and not c.needs]
    todo += CANARIES
    argvs = [substitute(c, mnist_dir) for c in todo]
    # A command written in several places is checked once (19 of 111 lines, ~20% of the time).
    unique = list(dict.fromkeys(tuple(a) for a in argvs))
    real = {tuple(a) for c, a in zip(todo, argvs, strict=True) if trains_for_real(c)}
    tmp = tmp_path_factory.mktemp("dry")
    commands = [{"argv": list(a), "real": a in real} for a in unique]
    (tmp / "commands.json").write_text(json.dumps(commands))
    env_args = [sys.executable, str(ROOT / "tests" / "doc_dry_run.py")]
    proc = subprocess.run(
        [*env_args, str(tmp / "commands.json"), str(tmp / "results.json")],
        cwd=workspace,
        capture_output=True,
        text=True,
        # One process runs every line in turn while the suite's other processes share the
        # cores: ~5 min on a quiet 2-core machine, more than twice that on a loaded one whose
        # CPU lacks native bf16 (the recipes' bf16 lines).
        timeout=1800,
        env={**_env(workspace)},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = dict(zip(unique, json.loads((tmp / "results.json").read_text()), strict=True))
    return {c.source + " " + c.text: results[tuple(a)] for c, a in zip(todo, argvs, strict=True)}


def user_path(cwd: Path) -> str:
    """The workspace (the docs' user code) on PYTHONPATH, before what was there: a checkout's
    own src/ given there stays the accel_train that runs."""
    import os

    return os.pathsep.join(filter(None, [str(cwd), os.environ.get("PYTHONPATH")]))


def _env(cwd: Path) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.pop("ACCEL_TRAIN_DATA_DIR", None)  # README.md's ./data
    env["PYTHONPATH"] = user_path(cwd)
    return env


def test_the_docs_have_commands():
    programs = {c.program for c in COMMANDS}
    assert {"accel-train", "accel-eval", "accel-export", "accel-sample", "accel-data"} <= programs
    assert "accel-report" in programs
    skipped = [c for c in COMMANDS if c.needs]
    # Marks are for what this machine cannot have; keep them few.
    assert len(skipped) <= max(8, len(COMMANDS) // 8), [c.source for c in skipped]


@pytest.mark.parametrize("command", COMMANDS, ids=_ids(COMMANDS))
def test_doc_command(command: DocCommand, workspace, mnist_dir, request):
    if command.needs:
        pytest.skip(f"needs: {command.needs} ({command.source})")
    if command.program in DRY:
        result = request.getfixturevalue("dry_results")[command.source + " " + command.text]
        assert result["rc"] == 0, (
            f"{command.source}: `{command.text}` exits {result['rc']}:\n{result['output']}"
        )
        return
    argv = substitute(command, mnist_dir)
    if made_first(command):
        proc = request.getfixturevalue("data_results")[command.source]
    else:
        env = {"PYTHONPATH": user_path(workspace)}
        proc = run_cli(argv[1:], workspace, prog=argv[0], timeout=300, env=env)
    assert proc.returncode == 0, (
        f"{command.source}: `{command.text}` exits {proc.returncode}:\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )


@pytest.mark.parametrize("canary", CANARIES, ids=[c.source for c in CANARIES])
def test_the_dry_run_refuses_a_broken_command(canary: DocCommand, dry_results):
    result = dry_results[canary.source + " " + canary.text]
    assert result["rc"] == 2, result["output"]
    assert "error" in result["output"], result["output"]
