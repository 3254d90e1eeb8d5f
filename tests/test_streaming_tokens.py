"""dataset=streaming_tokens and `accel-data shard dataset=tokens` (issue 20): a generated text
tokenized, sharded in LitData's token format to a local folder and to moto's S3 server
(conftest's `endpoint`), a tiny GPT trained from both through a cache smaller than the data (the
same losses), DDP ranks and loader workers reading disjoint windows, an exact mid-epoch resume,
`accel-sample` without the token folder, and the refusals of the other kind's shards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_same_weights, check_ok
from omegaconf import OmegaConf
from test_image_folder import write_image_folder
from test_streaming import KEY_ID, SECRET, _refused, chunk_bytes, losses, s3_env

from accel_train.data.shards.shard_set import META
from accel_train.data.text.dataset_tokenizer import dataset_tokenizer
from accel_train.data.text.streaming_tokens import build_streaming_tokens

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")

BUCKET = "accel-tokens"
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300))
CHUNK = "4KB"  # ~19.6 KB of train tokens (uint16): five chunks
SMALL_CACHE = "8kb"  # below the training chunks: chunks must be evicted
BLOCK = 16
LM = [
    "task=language_model",
    "model=gpt",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=16",
    f"model.block_size={BLOCK}",
    "dataset=streaming_tokens",
    "dataset.eval_windows=8",
    "loader.batch_size=8",
    "trainer.progress=none",
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    "logger=none",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory, endpoint, run_cli_in):
    """The text's token folder sharded to a folder and to the bucket, a token folder of
    distinct tokens (0, 1, 2, ...: a window's first token names it) sharded to a folder, and
    an image shard set."""
    import boto3

    root = tmp_path_factory.mktemp("streaming-tokens")
    (root / "input.txt").write_text(TEXT)
    env = s3_env(endpoint)
    check_ok(run_cli_in(["tokenize", "input=input.txt", "out=tokens"], root, prog="accel-data"))
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=SECRET,
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=BUCKET)
    s3 = f"s3://{BUCKET}/text"
    for out in (root / "shards", s3):
        args = ["shard", "dataset=tokens", "dataset.path=tokens", f"out={out}"]
        check_ok(run_cli_in([*args, f"chunk_bytes={CHUNK}"], root, prog="accel-data", env=env))
    counting = root / "counting"
    counting.mkdir()
    np.arange(4000, dtype=np.uint16).tofile(counting / "train.bin")
    np.arange(4000, 4400, dtype=np.uint16).tofile(counting / "val.bin")
    (counting / "meta.json").write_text(json.dumps({"vocab_size": 65535, "dtype": "uint16"}))
    args = ["shard", "dataset=tokens", "dataset.path=counting", "out=counting-shards"]
    check_ok(run_cli_in([*args, "chunk_bytes=1KB"], root, prog="accel-data"))
    images = write_image_folder(root / "images", 10, 1)
    args = ["shard", "dataset=image_folder", f"dataset.root={images}", "out=image-shards"]
    check_ok(run_cli_in(args, root, prog="accel-data"))
    return {
        "root": root,
        "local": root / "shards",
        "s3": s3,
        "counting": root / "counting-shards",
        "images": root / "image-shards",
    }


# ---- accel-data shard dataset=tokens -----------------------------------------------------------


def test_shard_writes_litdata_token_chunks_and_an_index(data, run_cli):
    shards = data["local"]
    meta = json.loads((shards / META).read_text())
    folder_meta = json.loads((data["root"] / "tokens" / "meta.json").read_text())
    assert meta["kind"] == "tokens" and meta["tokens"] == folder_meta
    train_tokens = (data["root"] / "tokens" / "train.bin").stat().st_size // 2
    assert meta["splits"]["train"]["tokens"] == train_tokens
    index = json.loads((shards / "train" / "index.json").read_text())
    assert index["config"]["data_format"] == ["no_header_numpy:5"]  # LitData's token format
    assert sum(c["dim"] for c in index["chunks"]) == train_tokens
    assert len(index["chunks"]) >= 4
    # An existing shard set is not replaced by accident (overwrite=true replaces it:
    # test_overwrite_replaces_only_a_shard_set_never_the_source_or_other_files).
    args = ["shard", "dataset=tokens", f"dataset.path={data['root'] / 'tokens'}", f"out={shards}"]
    _refused(run_cli(args, prog="accel-data"), "overwrite=true")
    # A token folder that is not there: one paragraph naming the key.
    missing = ["shard", "dataset=tokens", "dataset.path=nowhere", f"out={shards}-2"]
    _refused(run_cli(missing, prog="accel-data"), "dataset.path=nowhere")


def test_windows_are_the_token_folders_tokens_in_order(data):
    """(In-process.) Unshuffled, window i is tokens [17 i, 17 i + 17) of its chunk: the input
    is the first 16, the target the same shifted by one; validation windows are fixed."""
    splits = build_streaming_tokens(remote=str(data["counting"]), block_size=BLOCK)
    x, y = splits.train[0]
    assert x.tolist() == list(range(BLOCK)) and y.tolist() == list(range(1, BLOCK + 1))
    assert x.dtype == torch.int64 and splits.model_args == {"vocab_size": 65535}
    again = build_streaming_tokens(remote=str(data["counting"]), block_size=BLOCK, eval_windows=5)
    firsts = [int(again.val[i][0][0]) for i in range(len(again.val))]
    assert len(firsts) == 5 and firsts[0] == 4000 and firsts == sorted(firsts)


# ---- training: local and S3 through a small cache ------------------------------------------------


@pytest.fixture(scope="module")
def trained(data, endpoint, tmp_path_factory, run_cli_in):
    """An epoch from the local shards and one from the bucket, through one cache smaller than
    the data, each sampling a line at validation (task.sample_lines: decoded with the index's
    tokenizer); {"local"|"s3": (run dir, output), "cache": the cache}."""
    root = tmp_path_factory.mktemp("trained")
    cache = root / "cache"
    runs = {"cache": cache}
    for name, remote in (("local", data["local"]), ("s3", data["s3"])):
        args = [*LM, f"dataset.remote={remote}", "trainer.max_epochs=1", "task.sample_lines=1"]
        args += [f"dataset.local={cache}", f"dataset.cache_limit={SMALL_CACHE}"]
        run_dir = root / name
        proc = run_cli_in([*args, f"hydra.run.dir={run_dir}"], root, env=s3_env(endpoint))
        check_ok(proc)
        runs[name] = (run_dir, proc.stdout + proc.stderr)
    return runs


def test_local_and_s3_train_identically_through_a_cache_smaller_than_the_data(data, trained):
    cache = trained["cache"]
    runs = {name: trained[name][0] for name in ("local", "s3")}
    assert len(losses(runs["s3"])) > 50  # every window of the epoch, in batches of 8
    assert losses(runs["s3"]) == losses(runs["local"])
    train_cache = next(cache.glob("text-*")) / "train"
    assert chunk_bytes(train_cache) < chunk_bytes(data["local"] / "train")  # chunks evicted


# ---- order: ranks, workers, resume -----------------------------------------------------------


def _firsts(data, rank=0, world=1, workers=0, epoch=1, start_batch=0, remote=None):
    """Each batch's windows, named by their first token (distinct in the counting shards)."""
    remote = str(remote or data["counting"])
    splits = build_streaming_tokens(remote=remote, block_size=BLOCK, seed=5)
    cfg = OmegaConf.create(
        {
            "batch_size": 8,
            "num_workers": workers,
            "shuffle": True,
            "pin_memory": False,
            "prefetch_factor": 2,
            "multiprocessing_context": None,
            "drop_last": False,
        }
    )
    cpu = torch.device("cpu")
    loader = splits.train.make_loader(
        cfg, device=cpu, seed=5, rank=rank, world=world, limit=0, num_classes=0, labelled=False
    )
    try:
        return [x[:, 0].tolist() for x, _ in loader.epoch(epoch, start_batch)]
    finally:
        loader.close()


def test_the_order_is_seeded_by_epoch_and_ranks_and_workers_read_disjoint_windows(data):
    total = len(build_streaming_tokens(remote=str(data["counting"]), block_size=BLOCK).train)
    for workers in (0, 2):
        one = [i for b in _firsts(data, workers=workers) for i in b]
        assert len(one) == len(set(one)) == total
    assert _firsts(data) == _firsts(data)  # the same seed and epoch: the same batches
    assert _firsts(data, epoch=2) != _firsts(data)
    ranks = [_firsts(data, rank=r, world=2) for r in (0, 1)]
    seen = [{i for b in batches for i in b} for batches in ranks]
    assert len(ranks[0]) == len(ranks[1])  # every rank runs the same number of steps
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) >= total - 2 * 8


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_epoch_reads_exactly_the_windows_it_had_left(data, workers):
    full = _firsts(data, workers=workers)
    for k in (1, 3):
        assert _firsts(data, workers=workers, start_batch=k) == full[k:]


def test_stopped_mid_epoch_and_resumed_equals_an_uninterrupted_run(data, run_cli, tmp_path):
    common = [*LM, f"dataset.remote={data['local']}", "trainer.max_epochs=2"]
    common += ["trainer.limit_train_batches=12"]
    reference = tmp_path / "reference"
    check_ok(run_cli([*common, f"hydra.run.dir={reference}"]))
    run_dir = tmp_path / "run"
    first = [*common, "trainer.max_steps=8", "trainer.ckpt_every_n_steps=1", "resume=auto"]
    check_ok(run_cli([*first, f"hydra.run.dir={run_dir}"]))
    check_ok(run_cli([*common, "resume=auto", f"hydra.run.dir={run_dir}"]))
    assert_same_weights(run_dir / "checkpoints" / "last.pt", reference / "checkpoints" / "last.pt")
    assert losses(run_dir) == losses(reference) and len(losses(reference)) == 24


def test_ddp_with_two_processes_trains(data, run_cli, tmp_path):
    args = [*LM, f"dataset.remote={data['local']}", "trainer.max_epochs=1"]
    args += ["strategy=ddp", "launcher.nproc_per_node=2", f"hydra.run.dir={tmp_path / 'run'}"]
    check_ok(run_cli(args, timeout=300))
    # Each rank reads its half of the windows (test_the_order_...: disjoint), in batches of 8.
    per_rank = _firsts(data, rank=0, world=2, remote=data["local"])
    assert len(losses(tmp_path / "run")) == len(per_rank) > 10


# ---- accel-sample, the tokenizer from the index ------------------------------------------------


def test_sampling_a_streamed_run_needs_no_token_folder(trained, run_cli, tmp_path):
    run_dir, output = trained["local"]
    # task.sample_lines decodes its samples at validation with the index's tokenizer too.
    assert "sample 1: '" in output
    # Another directory, no data dir: the tokenizer can only come from the shard index.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ckpt = f"ckpt_path={run_dir / 'checkpoints' / 'best.pt'}"
    proc = run_cli([ckpt, "prompt=def", "max_new_tokens=30"], cwd=elsewhere, prog="accel-sample")
    check_ok(proc)
    assert proc.stdout.startswith("def") and set(proc.stdout) <= set(TEXT) | {"\n"}
    assert len(proc.stdout.strip()) >= 25


def test_a_bpe_tokenizer_is_kept_in_the_index(run_cli, tmp_path):
    (tmp_path / "input.txt").write_text(TEXT)
    bpe = ["tokenize", "input=input.txt", "out=bpe", "tokenizer=bpe", "vocab_size=300"]
    check_ok(run_cli(bpe, prog="accel-data"))
    shard = ["shard", "dataset=tokens", "dataset.path=bpe", "out=bpe-shards", "chunk_bytes=4KB"]
    check_ok(run_cli(shard, prog="accel-data"))
    shutil.rmtree(tmp_path / "bpe")
    ds = OmegaConf.create({"remote": str(tmp_path / "bpe-shards")})
    tokenizer, where = dataset_tokenizer(ds, None)
    assert tokenizer.kind == "bpe" and where.endswith(META)
    assert tokenizer.decode(tokenizer.encode("def f1(x):").tolist()) == "def f1(x):"


# ---- refusals: the other kind of shards --------------------------------------------------------


def test_each_streaming_option_refuses_the_other_kind_of_shards(data, run_cli):
    tokens = [*LM, f"dataset.remote={data['images']}", "trainer.max_steps=1"]
    _refused(run_cli(tokens), "dataset.remote=", "holds image shards", "dataset=streaming ")
    images = ["dataset=streaming", f"dataset.remote={data['local']}", "trainer.max_steps=1"]
    _refused(run_cli(images), "dataset.remote=", "holds token shards", "dataset=streaming_tokens")


def test_overwrite_replaces_only_a_shard_set_never_the_source_or_other_files(
    data, run_cli, tmp_path
):
    """`overwrite=true` removed whatever `out` held: a folder of the user's files, or the very
    token folder being sharded (issue 32)."""
    (tmp_path / "input.txt").write_text(TEXT[:3000])
    # The module's token folder (accel-data tokenize's, as the `data` fixture made it), copied.
    shutil.copytree(data["root"] / "tokens", tmp_path / "tok")

    def files(folder: Path) -> dict:
        return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}

    before = files(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    args = ["shard", "dataset=tokens", "dataset.path=tok", "chunk_bytes=1KB", "overwrite=true"]
    _refused(run_cli([*args, "out=tok"], prog="accel-data"), "out=tok", "dataset.path=tok")
    _refused(run_cli([*args, "out=."], prog="accel-data"), "out=.", "dataset.path=tok")
    _refused(run_cli([*args, "out=mine"], prog="accel-data"), "out=mine", "notes.txt")
    assert files(tmp_path) == {**before, Path("mine/notes.txt"): b"keep"}
    check_ok(run_cli([*args, "out=shards"], prog="accel-data"))
    check_ok(run_cli([*args, "out=shards"], prog="accel-data"))  # a shard set: replaced
    assert (tmp_path / "shards" / META).is_file()
    index = json.loads((tmp_path / "shards" / "train" / "index.json").read_text())
    assert index["chunks"][0]["dim"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["input.txt", "mine", "shards", "tok"]
