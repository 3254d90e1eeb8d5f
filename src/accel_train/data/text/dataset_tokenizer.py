"""The tokenizer a language model's data was made with: a token folder's meta.json
(dataset=tokens) or the copy a token shard set keeps in its index (dataset=streaming_tokens).
Apart from the streaming readers, so that a run that streams nothing (a token folder,
instruction records, accel-sample) does not import LitData (~0.5 s of start-up)."""

from __future__ import annotations

from omegaconf import DictConfig

from accel_train.data.shards.shard_set import META, read_meta
from accel_train.data.text.tokenizer import Tokenizer, tokenizer_description, tokenizer_from_meta
from accel_train.data.text.tokens import token_folder


def dataset_tokenizer(ds: DictConfig, data_dir: str | None) -> tuple[Tokenizer, str]:
    """The tokenizer a language model's data set was made with, and where it was read from: a
    token folder's meta.json (dataset=tokens) or the copy a token shard set keeps in its index
    (dataset=streaming_tokens)."""
    meta, bpe_json, where = tokenizer_data(ds, data_dir)
    return tokenizer_from_meta(meta, where, bpe_json), where


def tokenizer_data(ds: DictConfig, data_dir: str | None) -> tuple[dict, str | None, str]:
    """The same tokenizer as plain data (its meta, a BPE's tokenizer.json text, where it was
    read): what tokenizer_from_meta rebuilds it from, and what a checkpoint can keep."""
    if ds.get("remote"):
        remote = str(ds.remote).rstrip("/")
        meta = read_meta(remote, kind="tokens")
        return meta["tokens"], meta.get("tokenizer_json"), f"{remote}/{META}"
    folder = token_folder(str(ds.path), data_dir)
    meta, bpe_json = tokenizer_description(folder)
    return meta, bpe_json, str(folder / "meta.json")
