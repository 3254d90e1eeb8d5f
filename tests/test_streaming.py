"""dataset=streaming and `accel-data shard` (issue 20): a generated JPEG folder sharded with
LitData to a local folder and to moto's S3 server on 127.0.0.1 (plain http: the obstore shim),
trained from both through a cache smaller than the data (the same losses), the cache reused,
DDP ranks and loader workers reading disjoint samples, a mid-epoch resume that reads exactly the
rest of the epoch, and every fault as one paragraph with exit 2. Credentials never land in the
run dir."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import assert_same_weights, check_ok, free_port, read_jsonl
from omegaconf import OmegaConf
from test_image_folder import write_image_folder

from accel_train.data.images import streaming
from accel_train.data.shards.shard_set import META

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")

# Secret-looking values: the test greps every file of the run dir for them.
KEY_ID = "AKIAZZSECRETKEYID0042"
SECRET = "zzSeCrEt/ValueThatMustNotLeak+42"
BUCKET = "accel-test"
CHUNK = "20KB"  # 54 training JPEGs of ~1.2 KB: four chunks
SMALL_CACHE = "30kb"  # below the ~67 KB of training chunks: chunks must be evicted
TRAIN = [
    "dataset=streaming",
    "dataset.image_size=32",
    "model=small_cnn",
    "loader.batch_size=8",
    "trainer.progress=none",
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    "logger=none",
]


def s3_env(endpoint: str, **extra) -> dict[str, str]:
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        # Never ask an instance metadata service (a real address) for credentials.
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": "/nonexistent/aws-config",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
    }
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def data(tmp_path_factory, endpoint, run_cli_in):
    """The JPEG folder, its shards in a local folder and in the bucket."""
    import boto3

    root = tmp_path_factory.mktemp("streaming")
    tree = write_image_folder(root / "images", 20, 4)  # 54 train + 6 val, 12 test
    env = s3_env(endpoint)
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=SECRET,
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=BUCKET)
    shard = ["dataset=image_folder", f"dataset.root={tree}", f"chunk_bytes={CHUNK}"]
    shard.append("dataset.holdout=true")  # val/ tests, 10 % of train/ validates (as before)
    outs = (root / "shards", f"s3://{BUCKET}/images", f"s3://{BUCKET}/images-again")

    # All three at once: shard jobs on one machine must not share LitData's staging folder
    # (they did, and uploaded or deleted each other's chunks).
    def run(out):
        return run_cli_in(["shard", *shard, f"out={out}"], root, prog="accel-data", env=env)

    with ThreadPoolExecutor(len(outs)) as pool:
        for proc in pool.map(run, outs):
            check_ok(proc)
    return {
        "root": root,
        "tree": tree,
        "local": root / "shards",
        "s3": f"s3://{BUCKET}/images",
        "client": client,
    }


def losses(run_dir: Path) -> list[float]:
    return [m["train/loss"] for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m]


def chunk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("chunk-*.bin"))


# ---- accel-data shard ------------------------------------------------------------------------


def test_shard_writes_litdata_shards_and_an_index(data, run_cli):
    shards = data["local"]
    meta = OmegaConf.to_container(OmegaConf.load(shards / META))
    assert meta["classes"] == ["ant", "bee", "cat"]
    counts = {k: v["samples"] for k, v in meta["splits"].items()}
    assert counts == {"train": 54, "val": 6, "test": 12}
    for split in ("train", "val", "test"):
        assert (shards / split / "index.json").is_file()
    assert len(list((shards / "train").glob("chunk-*.bin"))) >= 3
    # The sets sharded to the bucket at the same time are whole and alike, chunk for chunk.
    listed = {}
    for prefix in ("images/", "images-again/"):
        objects = data["client"].list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]
        listed[prefix] = {o["Key"].removeprefix(prefix): o["Size"] for o in objects}
    assert listed["images/"].keys() == listed["images-again/"].keys()
    local = {str(p.relative_to(shards)): p.stat().st_size for p in shards.rglob("chunk-*.bin")}
    for objects in listed.values():
        assert {k: v for k, v in objects.items() if "chunk-" in k} == local
    # An existing shard set is not replaced by accident.
    shard = ["shard", "dataset=image_folder", f"dataset.root={data['tree']}", f"out={shards}"]
    proc = run_cli(shard, prog="accel-data")
    assert proc.returncode == 2 and "overwrite=true" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_s3_prefix_of_other_objects_is_never_overwritten(data, endpoint, run_cli):
    """`overwrite=true` replaces only a shard set (its accel_train.index.json), on S3 as in a
    folder: a prefix of the user's own objects is refused (issue 32)."""
    client = data["client"]
    client.put_object(Bucket=BUCKET, Key="mine/notes.txt", Body=b"keep")
    out = f"out=s3://{BUCKET}/mine"
    args = ["shard", "dataset=image_folder", f"dataset.root={data['tree']}", out, "overwrite=true"]
    _refused(run_cli(args, prog="accel-data", env=s3_env(endpoint)), out, "not a shard set")
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix="mine/")["Contents"]
    assert [o["Key"] for o in listed] == ["mine/notes.txt"]
    # Nor a shard set holding an object of the user's inside a split (LitData's overwrite mode
    # empties the split's prefix; issue 39).
    bucket, prefix = data["s3"].removeprefix("s3://").split("/", 1)
    planted = f"{prefix}/train/extra/mine.txt"
    client.put_object(Bucket=bucket, Key=planted, Body=b"keep")
    try:
        out = f"out={data['s3']}"
        args[3] = out
        _refused(run_cli(args, prog="accel-data", env=s3_env(endpoint)), "train/extra/mine.txt")
        assert client.get_object(Bucket=bucket, Key=planted)["Body"].read() == b"keep"
    finally:
        client.delete_object(Bucket=bucket, Key=planted)  # (the module's shard set, as it was)
    # A shard set of its own (LitData's chunks and index only) is still replaced.
    args[3] = f"out=s3://{BUCKET}/images-again"
    check_ok(run_cli([*args, f"chunk_bytes={CHUNK}"], prog="accel-data", env=s3_env(endpoint)))


# ---- training: local and S3, a small cache, the cache reused ---------------------------------


def test_local_and_s3_train_identically_through_a_cache_smaller_than_the_data(
    data, endpoint, run_cli, tmp_path
):
    env = s3_env(endpoint)
    cache = tmp_path / "cache"
    runs = {}
    for name, remote in (("local", data["local"]), ("s3", data["s3"])):
        runs[name] = tmp_path / name
        args = [*TRAIN, f"dataset.remote={remote}", "trainer.max_epochs=2"]
        args += [f"dataset.local={cache}", f"dataset.cache_limit={SMALL_CACHE}"]
        check_ok(run_cli([*args, f"hydra.run.dir={runs[name]}"], env=env))
    assert len(losses(runs["s3"])) == 14  # 2 epochs of 54 samples in batches of 8
    assert losses(runs["s3"]) == losses(runs["local"])
    train_cache = next(cache.glob("images-*")) / "train"
    # Used chunks were evicted: fewer training bytes are left than the data set has.
    assert chunk_bytes(train_cache) < chunk_bytes(data["local"] / "train")
    # The credentials are in the environment only: no file of the run holds them.
    for run_dir in runs.values():
        for path in run_dir.rglob("*"):
            if path.is_file():
                content = path.read_bytes()
                assert KEY_ID.encode() not in content and SECRET.encode() not in content, path


def test_a_second_run_reuses_the_cache(data, endpoint, run_cli, tmp_path):
    env = s3_env(endpoint)
    cache = tmp_path / "cache"
    args = [*TRAIN, f"dataset.remote={data['s3']}", f"dataset.local={cache}", "trainer.max_steps=3"]
    check_ok(run_cli([*args, f"hydra.run.dir={tmp_path / 'one'}"], env=env))
    cached = {p: p.stat().st_mtime_ns for p in cache.rglob("chunk-*.bin")}
    assert len(cached) >= 5  # train chunks (no eviction under 20gb), val and test
    check_ok(run_cli([*args, f"hydra.run.dir={tmp_path / 'two'}"], env=env))
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("chunk-*.bin")} == cached


# ---- order: ranks, workers, resume -----------------------------------------------------------


def _indices(data, rank=0, world=1, workers=0, epoch=1, start_batch=0) -> list[list[int]]:
    """The sample indices of each batch the streaming loader gives (decoding skipped)."""
    splits = streaming.build_streaming(remote=str(data["local"]), image_size=32)
    source = splits.train.source
    source.decoder = _IndexOnly()
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
    loader = splits.train.make_loader(
        cfg,
        device=torch.device("cpu"),
        seed=5,
        rank=rank,
        world=world,
        limit=0,
        num_classes=1000,
    )
    try:
        return [y.tolist() for _, y in loader.epoch(epoch, start_batch)]
    finally:
        loader.close()


class _IndexOnly:
    def __call__(self, item, epoch):
        return torch.zeros(1), int(item["index"])


def test_the_order_is_seeded_by_epoch_and_workers_read_disjoint_samples(data):
    one = _indices(data, workers=0)
    flat = [i for b in one for i in b]
    assert len(flat) == len(set(flat)) == 54
    assert _indices(data, workers=0) == one  # the same seed and epoch: the same batches
    assert _indices(data, workers=0, epoch=2) != one
    # Loader workers read disjoint chunks (LitData gives each its own), all of the epoch; the
    # order depends on how many there are (docs/streaming.md).
    two = [i for b in _indices(data, workers=2) for i in b]
    assert len(two) == len(set(two)) == 54
    assert _indices(data, workers=2) == _indices(data, workers=2)


def test_ddp_ranks_read_disjoint_samples(data):
    ranks = [_indices(data, rank=r, world=2) for r in (0, 1)]
    seen = [{i for b in batches for i in b} for batches in ranks]
    assert len(ranks[0]) == len(ranks[1])  # every rank runs the same number of steps
    assert not seen[0] & seen[1]
    assert len(seen[0]) + len(seen[1]) >= 54 - 2 * 8  # LitData drops at most a batch's tail


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_epoch_reads_exactly_the_samples_it_had_left(data, workers):
    full = _indices(data, workers=workers)
    for k in (1, 3):
        before, after = full[:k], _indices(data, workers=workers, start_batch=k)
        assert after == full[k:]
        seen = [i for b in before + after for i in b]
        assert len(seen) == len(set(seen)) == 54


def test_killed_mid_epoch_and_resumed_equals_an_uninterrupted_run(data, run_cli, tmp_path):
    common = [*TRAIN, f"dataset.remote={data['local']}", "trainer.max_epochs=2"]
    common += ["loader.num_workers=2"]
    reference = tmp_path / "reference"
    check_ok(run_cli([*common, f"hydra.run.dir={reference}"]))
    run_dir = tmp_path / "run"
    first = [*common, "trainer.max_steps=8", "trainer.ckpt_every_n_steps=1", "resume=auto"]
    check_ok(run_cli([*first, f"hydra.run.dir={run_dir}"]))
    # Mid-epoch (batch 1 of epoch 1), LitData's order depends on the worker count: refused.
    other = [*common, "loader.num_workers=0", "resume=auto", f"hydra.run.dir={run_dir}"]
    _refused(run_cli(other), "loader.num_workers=2", "repeat or skip")
    check_ok(run_cli([*common, "resume=auto", f"hydra.run.dir={run_dir}"]))
    assert_same_weights(run_dir / "checkpoints" / "last.pt", reference / "checkpoints" / "last.pt")
    assert losses(run_dir) == losses(reference)


def test_ddp_with_two_processes_trains(data, run_cli, tmp_path):
    args = [*TRAIN, f"dataset.remote={data['local']}", "trainer.max_epochs=1"]
    args += ["strategy=ddp", "launcher.nproc_per_node=2", f"hydra.run.dir={tmp_path / 'run'}"]
    check_ok(run_cli(args, timeout=300))
    assert len(losses(tmp_path / "run")) == 3  # 54 samples / 2 ranks / 8 = 3 steps


# ---- faults: one paragraph, exit 2 -----------------------------------------------------------


def _refused(proc, *texts):
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    for text in texts:
        assert text in proc.stderr, proc.stderr


def _copy(data, tmp_path) -> Path:
    return Path(shutil.copytree(data["local"], tmp_path / "shards"))


def test_faults_of_the_object_store(data, endpoint, run_cli, tmp_path):
    base = [*TRAIN, f"dataset.local={tmp_path / 'cache'}", "trainer.max_epochs=1"]
    closed = f"http://127.0.0.1:{free_port()}"
    cases = [
        (data["s3"], s3_env(closed, AWS_MAX_ATTEMPTS="2"), ["cannot reach", closed]),
        ("s3://no-such-bucket/x", s3_env(endpoint), ["no-such-bucket", "does not exist"]),
        (f"s3://{BUCKET}/nothing", s3_env(endpoint), ["nothing", "accel-data shard"]),
    ]
    no_keys = s3_env(endpoint, AWS_ACCESS_KEY_ID="", AWS_SECRET_ACCESS_KEY="")
    cases.append((data["s3"], no_keys, ["no S3 credentials", "AWS_ACCESS_KEY_ID"]))
    for remote, env, texts in cases:
        proc = run_cli([*base, f"dataset.remote={remote}"], env=env)
        _refused(proc, *texts)
    # The cache folder cannot be created (a file is in the way).
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = run_cli(
        [*TRAIN, f"dataset.remote={data['s3']}", f"dataset.local={blocker / 'cache'}"],
        env=s3_env(endpoint),
    )
    _refused(proc, "dataset.local=", "writable")


def test_faults_of_the_shards(data, run_cli, tmp_path):
    shards = _copy(data, tmp_path)
    args = [*TRAIN, f"dataset.remote={shards}", "trainer.max_epochs=1"]
    chunk = sorted((shards / "train").glob("chunk-*.bin"))[1]
    # A chunk of another size than its index records.
    good = chunk.read_bytes()
    chunk.write_bytes(good[:-100])
    _refused(run_cli(args), chunk.name, "truncated")
    # A corrupt chunk (its bytes overwritten, its size unchanged): found while reading it.
    chunk.write_bytes(good[:2000] + os.urandom(len(good) - 2100) + good[-100:])
    _refused(run_cli(args), "dataset.remote", chunk.name)
    # A missing chunk.
    chunk.unlink()
    _refused(run_cli(args), chunk.name, "missing")
    chunk.write_bytes(good)
    # An index that belongs to other shards.
    shutil.copy(shards / "val" / "index.json", shards / "train" / "index.json")
    _refused(run_cli(args), "index.json", "different runs")
    # No shard set at all.
    _refused(run_cli([*TRAIN, f"dataset.remote={tmp_path}"]), "accel-data shard")


def test_a_split_that_would_be_empty_is_refused_before_writing(run_cli, tmp_path):
    """Too few images for dataset.val_fraction: one paragraph naming the split and the fix, and
    no shard folder left behind (LitData itself raises a bare ValueError on an empty split)."""
    few = write_image_folder(tmp_path / "few", n_train=2, n_val=1)
    out = tmp_path / "shards"
    # (a hold-out asked for: with a val/ folder the validation split is val/, issue 47 F.28)
    carve = ["dataset.holdout=true", f"out={out}"]
    proc = run_cli(
        ["shard", "dataset=image_folder", f"dataset.root={few}", *carve], prog="accel-data"
    )
    _refused(proc, "val split would hold no image", "dataset.val_fraction")
    assert not out.exists()
    # Nor into the data being sharded (its files would be one more class of train/), nor
    # shrunk to nothing: both refused at once, before the header check, nothing written.
    before = sorted(p.relative_to(few) for p in few.rglob("*"))
    inside = few / "train" / "shards"
    shard = ["shard", "dataset=image_folder", f"dataset.root={few}", "max_side=1"]
    proc = run_cli([*shard, f"out={inside}"], prog="accel-data")
    _refused(proc, f"out={inside} is inside dataset.root={few}", "Choose a folder outside it")
    assert "max_side=1" in proc.stderr and "at least 32" in proc.stderr
    assert sorted(p.relative_to(few) for p in few.rglob("*")) == before
