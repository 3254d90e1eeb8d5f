"""Issue 61, the features at real scale: GRPO's everyday reward functions (numpy and tensor
numbers, async functions run together, TRL's `trainer_state` keyword, `task.reward_timeout_s`)
and every end-of-turn id stopping a completion (the model's generation_config as well as the
tokenizer's EOS); loader=ray's per-worker prefetch and runtime_env (its plan, no Ray started);
the video recipe's schedule in epochs, the shard command's short side, the device batch of
a clip evaluation."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from grpo_fixtures import user_code
from helpers import check_ok, read_jsonl
from hf_fixtures import write_tiny_llama

from accel_train.errors import UserError
from accel_train.rewards import RewardState, build_rewards, score
from accel_train.tasks.grpo import GRPO

# ---- C.14 everyday reward functions -----------------------------------------------------------


REWARDS = """
import asyncio
import time

import numpy as np
import torch


def numbers(prompts, completions, **kwargs):
    '''One of each kind of number TRL's torch.tensor(...) takes, in turn.'''
    kinds = [np.float32(1.0), np.int64(0), torch.tensor(0.5), True, 1, np.array(0.25)]
    return [kinds[i % len(kinds)] for i in range(len(completions))]


async def slow_async(prompts, completions, **kwargs):
    await asyncio.sleep(0.4)
    return [0.25] * len(completions)


async def slow_async_too(prompts, completions, **kwargs):
    await asyncio.sleep(0.4)
    return np.full(len(completions), 0.75, dtype=np.float32)


def by_step(completions, trainer_state, answer):
    '''Names its keywords (no **kwargs): gets only those, TRL's trainer_state among them.'''
    assert len(answer) == len(completions)
    return [float(trainer_state.global_step)] * len(completions)


def hangs(prompts, completions, **kwargs):
    time.sleep(30)
    return [0.0] * len(completions)


async def hangs_async(prompts, completions, **kwargs):
    await asyncio.sleep(30)
    return [0.0] * len(completions)


def not_a_number(prompts, completions, **kwargs):
    return ["1.0"] * len(completions)


def infinite(prompts, completions, **kwargs):
    return [np.float32("inf")] * len(completions)
"""


@pytest.fixture(scope="module")
def user_env(tmp_path_factory) -> dict[str, str]:
    """The user's reward module, scale61_rewards.py, on PYTHONPATH (the CLI) and sys.path."""
    root = tmp_path_factory.mktemp("user_code")
    env = user_code(root, {"scale61_rewards.py": REWARDS})
    sys.path.insert(0, str(root))
    yield env
    sys.path.remove(str(root))
    sys.modules.pop("scale61_rewards", None)


def _rewards(*names: str):
    return build_rewards([{"_target_": f"scale61_rewards.{n}"} for n in names])


def test_rewards_take_any_real_number_async_functions_together_and_a_time_limit(user_env):
    prompts, completions = ["p"] * 6, ["c"] * 6
    columns = {"answer": ["1"] * 6, "trainer_state": RewardState(global_step=3)}
    got = score(_rewards("numbers", "by_step"), prompts, completions, columns, list(range(6)))
    assert got == [[1.0, 0.0, 0.5, 1.0, 1.0, 0.25], [3.0] * 6]
    assert all(type(v) is float for v in got[0])
    # two async functions of 0.4 s each run concurrently on one loop (TRL's asyncio.gather)
    start = time.perf_counter()
    out = score(_rewards("slow_async", "slow_async_too"), prompts, completions, columns, [0] * 6)
    assert time.perf_counter() - start < 0.75
    assert out == [[0.25] * 6, [0.75] * 6]
    # non-numbers and infinities are still refused, naming the function
    refused = [("not_a_number", "returned '1.0'"), ("infinite", r"returned np.float32\(inf\)")]
    for name, needle in refused:
        with pytest.raises(UserError, match=f"'{name}'.*{needle}.*finite real number"):
            score(_rewards(name), prompts, completions, columns, [7] * 6)
    # a hanging function, plain or async, is stopped at the limit, named
    for name in ("hangs", "hangs_async"):
        start = time.perf_counter()
        with pytest.raises(UserError) as err:
            score(_rewards(name), prompts, completions, columns, [4] * 6, timeout=0.3)
        assert time.perf_counter() - start < 2
        text = str(err.value)
        assert f"'{name}'" in text and "task.reward_timeout_s=0.3" in text and "[4]" in text


# ---- C.12 end of turn: every id TRL stops on --------------------------------------------------

G, C = 4, 6
X = 100  # an ordinary token the model below always samples; its generation_config ends on it


@pytest.fixture(scope="module")
def always_x(tmp_path_factory) -> Path:
    """A tiny Llama that samples token X every time (a constant hidden state, only X's output
    row set), whose generation_config ends a turn on the tokenizer's EOS and on X: a chat
    model whose end-of-turn token is not the tokenizer's eos_token."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder = write_tiny_llama(tmp_path_factory.mktemp("scale61") / "llama")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        model.lm_head.weight[X] = 1.0  # logit 64 for X, 0 for every other token
    eos = model.config.eos_token_id
    model.generation_config = GenerationConfig(eos_token_id=[eos, X], pad_token_id=eos)
    model.save_pretrained(folder)
    return folder


def test_completions_stop_on_the_models_end_of_turn_and_rewards_of_any_number(
    always_x, user_env, tmp_path, run_cli
):
    """Through the CLI: the completions end at X (length 1, none clipped) though the tokenizer's
    EOS is another id; numpy/tensor rewards, an async function and one reading
    trainer_state.global_step are scored; a hanging reward stops the run in one paragraph."""
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"Say {i}.", "answer": str(i % 4)}) + "\n" for i in range(8))
    )
    run = tmp_path / "run"
    base = ["task=grpo", "dataset=prompts", "model=hf", f"model.path={always_x}",
            f"dataset.path={data}", "lora.rank=4", "lora.dropout=0.0",
            f"task.num_generations={G}", f"task.max_completion_length={C}", "scheduler=none",
            "loader.batch_size=2", "trainer.log_every_n_steps=1", "trainer.progress=none",
            "trainer.limit_val_batches=0"]  # fmt: skip
    rewards = ", ".join(f"{{_target_: scale61_rewards.{n}}}" for n in
                        ("numbers", "slow_async", "by_step"))  # fmt: skip
    rewards, env = f"task.rewards=[{rewards}]", user_env
    check_ok(run_cli([*base, rewards, "trainer.max_steps=2", f"hydra.run.dir={run}"], env=env))
    train = [r for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["train/completions/max_length"] == 1  # stopped at X, the model's end of turn
        assert r["train/completions/clipped_ratio"] == 0
        assert r["train/rewards/numbers/mean"] == pytest.approx((1 + 0 + 0.5 + 1 + 1 + 0.25
                                                                + 1 + 0) / 8)  # fmt: skip
        assert r["train/rewards/slow_async/mean"] == pytest.approx(0.25)
    assert [r["train/rewards/by_step/mean"] for r in train] == [0.0, 1.0]

    hang = [*base, "task.rewards=[{_target_: scale61_rewards.hangs}]", "task.reward_timeout_s=1",
            "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'hang'}"]  # fmt: skip
    start = time.perf_counter()
    proc = run_cli(hang, env=env)
    assert time.perf_counter() - start < 25  # the 30 s sleep left behind
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "'hangs' (task.rewards[0]._target_=scale61_rewards.hangs) did not return" in proc.stderr
    assert "task.reward_timeout_s=1 s" in proc.stderr


def test_the_layout_masks_after_any_stop_id(user_env):
    """Unit: with the tokenizer's EOS 2 and the model's end of turn 9, each row is cut at its
    first of either; a row with neither runs to the cap and counts as truncated."""
    task = GRPO(num_generations=2, max_completion_length=4,
                rewards=[{"_target_": "scale61_rewards.numbers"}])  # fmt: skip
    task.eos, task.model_stops, task.pad = 2, [2, 9], 0
    assert task.stops == [2, 9] and task._stop_arg() == [2, 9]
    ids, pmask = torch.tensor([[5, 6], [5, 6]]), torch.ones(2, 2, dtype=torch.long)
    done = torch.tensor([[7, 9, 8, 8], [7, 7, 7, 7]])
    roll = task._layout(ids, pmask, done)
    assert roll["shown"].tolist() == [[True, True, False, False], [True] * 4]
    assert roll["truncated"].tolist() == [False, True]


# ---- A.2 / A.3 loader=ray: prefetch per worker, runtime_env on the actors (no Ray started) ----


class _Ref:
    def __init__(self, value):
        self.value = value


class _FakeRay:
    """The part of Ray the pool calls, in this process: what the actors were started with and
    how many batches were in flight at most. Ray itself is tested in tests/test_ray_loader.py."""

    class exceptions:  # noqa: N801 (ray.exceptions)
        class GetTimeoutError(Exception): ...

        class RayActorError(Exception): ...

        class ObjectLostError(Exception): ...

    def __init__(self, initialised: bool):
        self.initialised, self.options, self.in_flight, self.most = initialised, [], 0, 0

    def is_initialized(self):
        return self.initialised

    def init(self, **kwargs):
        self.initialised, self.init_kwargs = True, kwargs

    def shutdown(self):
        self.initialised = False

    def put(self, value):
        return _Ref(value)

    def kill(self, actor):
        pass

    def remote(self, cls):
        fake = self

        class Method:
            def __init__(self, fn, counts: bool):
                self.fn, self.counts = fn, counts

            def remote(self, *args):
                if self.counts:
                    fake.in_flight += 1
                    fake.most = max(fake.most, fake.in_flight)
                return _Ref((self.fn(*args), self.counts))

        class Actor:
            def __init__(self, name):
                self.where = Method(lambda: (name, 1, "here"), False)
                self.batch = Method(lambda maker, keys: (torch.tensor(keys), 0.0), True)

        class Remote:
            def options(self, **options):
                fake.options.append(options)
                return self

            def remote(self, name):
                return Actor(name)

        return Remote()

    def get(self, ref, timeout=None):
        if isinstance(ref, list):
            return [self.get(r) for r in ref]
        value, counts = ref.value
        self.in_flight -= counts
        return value


def _ray_loader_cfg(**overrides):
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(__file__).parents[1] / "configs" / "loader" / "ray.yaml")
    cfg.pop("defaults")
    return OmegaConf.merge(cfg, overrides)


@pytest.mark.parametrize("initialised", [False, True], ids=["local", "already-running"])
def test_ray_prefetch_is_per_worker_and_runtime_env_is_on_the_actors(
    initialised, monkeypatch, caplog
):
    """3 workers, loader.prefetch=2: 6 batches in flight (every worker busy), said at start-up;
    runtime_env on every actor's options whoever started Ray; object_store_mb with Ray already
    running: one line that it does not apply (and ray.init not called)."""
    from accel_train import ray_cluster
    from accel_train.data.remote import ray_loader

    fake = _FakeRay(initialised)
    monkeypatch.setattr(ray_cluster, "import_ray", lambda *a: fake)
    env = {"working_dir": ".", "env_vars": {"A": "1"}}
    cfg = _ray_loader_cfg(num_workers=3, prefetch=2, runtime_env=env, object_store_mb=512)
    caplog.set_level("INFO", logger="accel_train")
    try:
        pool = ray_loader.pool_for(cfg, rank=0)
        batches = list(pool.ordered(_Ref(None), ([(0, i)] for i in range(20))))
    finally:
        ray_loader.close_pool()
    assert [int(b[0, 1]) for b in batches] == list(range(20))  # in order
    assert fake.most == 6
    assert "at most 6 batches in flight (loader.prefetch=2 per worker)" in caplog.text
    assert [o["runtime_env"] for o in fake.options] == [env] * 3
    assert "runtime_env" not in getattr(fake, "init_kwargs", {})
    said = "loader.object_store_mb=512 does not apply: Ray was already running"
    assert (said in caplog.text) == initialised
    if not initialised:
        assert fake.init_kwargs["object_store_memory"] == 512 * 2**20


# ---- B.7 the schedule in epochs -----------------------------------------------------------------


def _lrs_per_epoch(steps_per_epoch: int, epochs: int) -> list[float]:
    from omegaconf import OmegaConf

    from accel_train.optim import build_scheduler

    sched = OmegaConf.create({"name": "step", "warmup_steps": 0, "warmup_epochs": 2,
                              "step_size": 1000, "step_epochs": 1.5, "gamma": 0.1})  # fmt: skip
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(opt, sched, epochs * steps_per_epoch,
                                steps_per_epoch=steps_per_epoch)  # fmt: skip
    out = []
    for step in range(epochs * steps_per_epoch):
        if step % (steps_per_epoch // 2) == 0:  # at every half epoch
            out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


def test_a_schedule_in_epochs_is_the_same_per_epoch_on_any_number_of_processes():
    """1 process and 8 (the same data at 8x the global batch: 1/8 the steps an epoch) get the
    same lr at each half epoch after a warm-up of 2 epochs, and a decay every 1.5 after it."""
    one, eight = _lrs_per_epoch(96, 6), _lrs_per_epoch(12, 6)
    # the warm-up's ramp (linear from lr / warm-up steps) differs by at most one of its steps
    assert one[:4] == pytest.approx(eight[:4], abs=1 / 24)
    assert one[4:] == pytest.approx(eight[4:])
    assert one[4] == pytest.approx(1.0)  # warmed up at epoch 2
    assert one[7] == pytest.approx(0.1) and one[10] == pytest.approx(0.01)  # epochs 3.5, 5


def test_the_schedule_in_epochs_is_said_at_start_up(tmp_path, run_cli):
    """Through the CLI: 256 samples at batch 64 are 4 steps an epoch, which the line says."""
    from helpers import FAST

    proc = run_cli([*FAST, "scheduler=step", "scheduler.warmup_epochs=1",
                    "scheduler.step_epochs=0.5", "loader.batch_size=64", "trainer.max_epochs=2",
                    "trainer.log_every_n_steps=1", "logger=csv"])  # fmt: skip
    check_ok(proc)
    line = ("scheduler: warm-up 1 epochs = 4 steps; lr x0.1 every 0.5 epochs = 2 steps (this "
            "run's epoch: 4 optimizer steps at a global batch of 64)")  # fmt: skip
    assert line in proc.stdout + proc.stderr
    both = run_cli([*FAST, "scheduler.warmup_epochs=1", "scheduler.warmup_steps=5"])
    assert both.returncode == 2 and "Traceback" not in both.stderr, both.stderr[-3000:]
    assert "give the warm-up one way" in both.stderr


# ---- B.8 the shard command by the short side --------------------------------------------------


def _wide_videos(root: Path) -> Path:
    """2 classes x 3 videos of 64 x 36 (16:9), 4 frames, for `accel-data shard`."""
    import av

    for c, label in enumerate(("a", "b")):
        (root / "train" / label).mkdir(parents=True)
        for i in range(3):
            with av.open(str(root / "train" / label / f"{i}.mp4"), "w") as out:
                stream = out.add_stream("mpeg4", rate=15)
                stream.width, stream.height, stream.pix_fmt = 64, 36, "yuv420p"
                for t in range(4):
                    img = np.full((36, 64, 3), 40 + 60 * c + 10 * t, np.uint8)
                    out.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
                out.mux(stream.encode())
    return root


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    pytest.importorskip("av")
    pytest.importorskip("torchcodec")
    return _wide_videos(tmp_path_factory.mktemp("wide") / "videos")


def test_shard_by_the_short_side_and_refuse_frames_below_the_crop(wide, tmp_path, run_cli):
    """16:9 videos: max_side=48 would store 48 x 28 frames, under the 32 px crop: refused in one
    paragraph naming min_side, nothing written; min_side=32 stores 56 x 32."""
    pytest.importorskip("litdata")
    videos = wide
    base = ["shard", "dataset=video_folder", f"dataset.root={videos}", "dataset.image_size=32",
            "dataset.frames=2", "dataset.frame_stride=1", "dataset.val_fraction=0.34",
            f"dataset.metadata_cache={tmp_path / 'cache'}"]  # fmt: skip
    proc = run_cli([*base, "max_side=48", f"out={tmp_path / 'capped'}"], prog="accel-data")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "would be stored smaller than dataset.image_size=32" in proc.stderr
    assert "`min_side=128`" in proc.stderr and "at 48x28" in proc.stderr
    assert not (tmp_path / "capped").exists()
    check_ok(run_cli([*base, "min_side=32", f"out={tmp_path / 'short'}"], prog="accel-data"))
    index = json.loads((tmp_path / "short" / "accel_train.index.json").read_text())
    sizes = {tuple(s) for info in index["splits"].values() for s in info["size"]}
    assert sizes == {(32, 56)} and index["min_side"] == 32


# ---- B.10 the device batch of a clip evaluation ----------------------------------------------


def test_the_device_batch_of_an_evaluation_by_views_is_said(wide, tmp_path, run_cli):
    """loader.eval_batch_size=2 videos of 2 clips x 3 crops: the device sees 12 clips a batch,
    said at start-up."""
    proc = run_cli(["model=video_cnn", "dataset=video_folder", f"dataset.root={wide}",
                    "dataset.image_size=32", "dataset.resize_size=32", "dataset.frames=2",
                    "dataset.frame_stride=1", "dataset.val_fraction=0.34", "dataset.eval_clips=2",
                    "dataset.eval_crops=3", f"dataset.metadata_cache={tmp_path / 'cache'}",
                    "loader.batch_size=2", "loader.eval_batch_size=2", "trainer.max_steps=1",
                    "trainer.progress=none", "logger=none"])  # fmt: skip
    check_ok(proc)
    views = "each 6 views (dataset.eval_clips=2 x dataset.eval_crops=3)"
    line = f"evaluation: loader.eval_batch_size=2 counts samples, {views}: the device sees 12"
    assert line in proc.stdout + proc.stderr
