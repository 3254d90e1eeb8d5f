"""Where the modules a saved config names have moved to (issue 59): the one mapping from an
old dotted path to its new one, applied wherever a config written by an earlier version is read
back (a run dir's config.yaml, a checkpoint's stored config) and to the user's own overrides
(`dataset._target_=accel_train.data.image_folder.build_image_folder`), so that runs written
before a move still resume (`resume=auto`, `resume=<path>`) and evaluate (`accel-eval
ckpt_path=...`), and an old command line still means what it meant.

`MOVED` maps a module (or one object of it, e.g. a class that changed module) to where it is
now; the longest key that prefixes a dotted path wins. Only dotted paths under a key are
rewritten: `accel_train.data.streaming` renames `accel_train.data.streaming.build_streaming`,
never `accel_train.data.streaming_tokens...`. Add a line here with every module that moves.
Imports nothing of accel_train: the config layer's lowest step."""

from __future__ import annotations

from typing import Any

# old dotted path -> new dotted path (a module, or one object of a module)
MOVED: dict[str, str] = {
    "accel_train.data.image_folder": "accel_train.data.images.folder",
    "accel_train.data.decode": "accel_train.data.images.decode",
    "accel_train.data.photos": "accel_train.data.images.folder_uncached",
    "accel_train.data.recipe": "accel_train.data.images.sample_recipe",
    "accel_train.data.batch_mix": "accel_train.data.images.batch_mix",
    "accel_train.data.streaming": "accel_train.data.images.streaming",
    "accel_train.data.image_crops": "accel_train.data.crops",
    "accel_train.data.image_tree": "accel_train.data.folder_tree",
    "accel_train.data.video_folder": "accel_train.data.video.folder",
    "accel_train.data.video_decode": "accel_train.data.video.decode",
    "accel_train.data.video_clips": "accel_train.data.video.clips",
    "accel_train.data.video_metadata_cache": "accel_train.data.video.metadata_cache",
    "accel_train.data.streaming_video": "accel_train.data.video.streaming",
    "accel_train.data.tokens": "accel_train.data.text.tokens",
    "accel_train.data.tokenizer": "accel_train.data.text.tokenizer",
    "accel_train.data.data_tokenizer": "accel_train.data.text.dataset_tokenizer",
    "accel_train.data.sft": "accel_train.data.text.sft",
    "accel_train.data.records": "accel_train.data.text.records",
    "accel_train.data.preference": "accel_train.data.text.preference",
    "accel_train.data.prompts": "accel_train.data.text.prompts",
    "accel_train.data.prompts.RepeatedOrder": "accel_train.data.orders.RepeatedOrder",
    "accel_train.data.loaders.ShardedOrder": "accel_train.data.orders.ShardedOrder",
    "accel_train.data.streaming_tokens": "accel_train.data.text.streaming_tokens",
    "accel_train.data.streaming_sft": "accel_train.data.text.streaming_sft",
    "accel_train.data.streaming_preference": "accel_train.data.text.streaming_preference",
    "accel_train.data.shard_reader": "accel_train.data.shards.reader",
    "accel_train.data.shard_set": "accel_train.data.shards.shard_set",
    "accel_train.data.object_store": "accel_train.data.shards.object_store",
    "accel_train.data.ray_loader": "accel_train.data.remote.ray_loader",
    "accel_train.data.ray_pool": "accel_train.data.remote.ray_pool",
}


def moved(path: str) -> str:
    """`path` (a dotted path, e.g. a `_target_`) as it is named now; itself when nothing it
    names has moved."""
    if not path.startswith("accel_train."):
        return path
    best = ""
    for old in MOVED:
        if (path == old or path.startswith(old + ".")) and len(old) > len(best):
            best = old
    return MOVED[best] + path[len(best) :] if best else path


def renamed(tree: Any) -> Any:
    """A plain config tree (dicts, lists, values) with every string that is a moved dotted path
    renamed (a `_target_`, or any value naming a module of accel_train); the tree itself when
    nothing in it moved, so an unchanged config is the very same object."""
    if isinstance(tree, str):
        return moved(tree)
    if isinstance(tree, dict):
        new = {k: renamed(v) for k, v in tree.items()}
        return tree if all(new[k] is tree[k] for k in tree) else new
    if isinstance(tree, list):
        items = [renamed(v) for v in tree]
        return tree if all(a is b for a, b in zip(items, tree)) else items
    return tree
