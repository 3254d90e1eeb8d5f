"""`model=hf`: a model in the Hugging Face layout from a local folder (config.json, the weights as
safetensors, the tokenizer's files), through transformers, offline.

- Never a network call: `local_files_only=True` and HF_HUB_OFFLINE=1; a hub id with no local
  copy is a one-paragraph error naming the layout expected.
- Never code from the folder: `trust_remote_code=False`, and weights only as safetensors
  (a `pytorch_model.bin` is a pickle; it is refused, with the one-line conversion).
- The weights load straight in the run's parameter dtype (`precision=bf16_true`: bf16, no fp32
  copy in memory).

The module the loop sees is `HFModel`: token ids (and, for packed rows, per-record positions)
in, logits out, the contract of `task=language_model` (or `task=classification` with
`head=sequence_classification`). The transformers model itself is `.hf`: export writes it back
with `save_pretrained`, and its `_no_split_modules` names the decoder blocks that FSDP shards
and activation checkpointing wraps.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from accel_train.config.device_checks import LIGER_MODEL_TYPES
from accel_train.errors import UserError
from accel_train.losses import output_layer

log = logging.getLogger("accel_train")

HEADS = ("causal_lm", "sequence_classification")
# Encoders that transformers builds as a "causal LM" only when config.is_decoder is true; with it
# false (as a masked-LM folder has it) they attend both ways: the loss would see the answer.
ENCODERS_AS_DECODERS = (
    "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
    "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer",
    "xlm-roberta", "xlm-roberta-xl", "xmod",
)  # fmt: skip

# Config keys of transformers models whose logits are not the output layer's alone: a final
# soft cap (Gemma 2/3), a scale (Cohere's logit_scale, Granite's logits_scaling, Falcon-H1's
# lm_head_multiplier). task.chunked_loss refuses a model that sets one.
LOGIT_CHANGES = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")

LAYOUT = (
    "a folder in the Hugging Face layout: config.json, the weights as model.safetensors (or "
    "model-*.safetensors with model.safetensors.index.json) and the tokenizer's files "
    "(tokenizer.json, tokenizer_config.json)"
)


def _transformers():
    """transformers, imported on first use (seconds): only runs that pick model=hf pay it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network call, whatever else happens
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # torchao (which transformers imports when installed) registers enums with torch's pytree
    # and torch warns about each one: noise in every run's log, nothing the user can act on.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    try:
        import transformers
    except ImportError:
        raise UserError(
            "model=hf needs the transformers package, which is not installed. Install the "
            'fine-tuning extra: `pip install "accel-train[hf]"` (transformers, peft, '
            "safetensors)."
        ) from None
    transformers.logging.set_verbosity_error()  # its progress bars and advice are not ours
    transformers.utils.logging.disable_progress_bar()
    return transformers


def model_folder(path: str | None, key: str = "model.path") -> Path:
    """The local folder `path` names, checked for the layout (config.json at least)."""
    if not path:
        raise UserError(
            f"{key} is required with model=hf: {LAYOUT}, e.g. one written by transformers' "
            "`save_pretrained` or `huggingface-cli download <id> --local-dir <folder>`."
        )
    folder = Path(str(path)).expanduser()
    if not folder.is_dir():
        hint = (
            " It looks like a hub id: accel-train never downloads; download it once with "
            f"`huggingface-cli download {path} --local-dir <folder>` and give that folder."
            if "/" in str(path) and not folder.parent.exists()
            else ""
        )
        raise UserError(f"{key}={path}: no such folder. Give {LAYOUT}.{hint}")
    config = folder / "config.json"
    if not config.is_file():
        raise UserError(f"{key}={path}: the folder has no config.json. Give {LAYOUT}.")
    _check_config_json(config, key, path)
    return folder


def _check_config_json(config: Path, key: str, path: str) -> None:
    """config.json read as JSON here: transformers' tokenizer loader reads it too, and its
    error would blame the tokenizer (the first thing a run, accel-sample and export load)."""
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        where = f"line {err.lineno}, column {err.colno}: {err.msg}" if hasattr(err, "msg") else err
        raise UserError(
            f"{key}={path}: {config} is not valid JSON ({where}). Restore it (e.g. from "
            "where the model came from, or write it again with the model's "
            "`config.save_pretrained`)."
        ) from None


def _check_weights(folder: Path, key: str) -> None:
    if any(folder.glob("*.safetensors")):
        return
    pickled = sorted(p.name for p in folder.glob("*.bin"))
    if pickled:
        raise UserError(
            f"{key}={folder}: its weights are {pickled[0]}, a pickle, and loading a pickle can run "
            "code stored in it, so accel-train reads safetensors only. Convert them once where "
            'you trust the file (AutoModelForCausalLM keeps the output head): `python -c "from '
            "transformers import AutoModelForCausalLM as M; "
            f"M.from_pretrained('{folder}').save_pretrained('{folder}-st')\"` and use the new "
            "folder."
        )
    raise UserError(
        f"{key}={folder}: no weights (*.safetensors) in the folder. Give {LAYOUT}, or "
        "`model.pretrained=false` to train the architecture from fresh weights."
    )


def _check_causal(config, path: str) -> None:
    """head=causal_lm trains next-token prediction: a model that sees the tokens after each
    position (an encoder, an encoder-decoder) would learn to copy them. Refused by its type."""
    kind = getattr(config, "model_type", "?")
    named = ", ".join(getattr(config, "architectures", None) or []) or f"model_type={kind}"
    bidirectional = kind in ENCODERS_AS_DECODERS and not getattr(config, "is_decoder", False)
    if bidirectional or getattr(config, "is_encoder_decoder", False):
        what = "an encoder-decoder (seq2seq)" if not bidirectional else "a bidirectional encoder"
        raise UserError(
            f"model.path={path}: its config.json describes {named}, {what} model, not a causal "
            "language model: each position would see the tokens it is asked to predict. "
            "model=hf trains decoder-only models (Llama, Qwen, Mistral, GPT-2, ...) with "
            "task=language_model; for a classifier on this encoder use `model.head="
            "sequence_classification task=classification`."
        )


def _check_head(info: dict, config, path: str) -> None:
    """Weights the folder lacks would start from random values: a causal LM without its
    output head (a folder saved from AutoModel) predicts noise, with no warning otherwise."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        tied = getattr(config, "tie_word_embeddings", False)
        raise UserError(
            f"model.path={path}: the folder's weights lack {', '.join(missing[:3])}"
            f"{' ...' if len(missing) > 3 else ''} (tie_word_embeddings={tied}), which would "
            "start from random values. A folder saved from transformers' AutoModel has no "
            "output head: save the model with AutoModelForCausalLM (it keeps lm_head), or "
            "`model.pretrained=false` to train the architecture from fresh weights."
        )


class HFModel(nn.Module):
    """A transformers model as the loop calls it: `forward(input_ids, position_ids=None)` ->
    logits. Positions restarting inside a row mark packed records: transformers then keeps the
    attention inside each record (its packed-sequence mask, which needs no cache and no
    attention mask, hence use_cache=False)."""

    def __init__(self, hf: nn.Module, path: str, head: str):
        super().__init__()
        self.hf = hf
        self.path, self.head = path, head
        # The blocks FSDP shards one by one and activation checkpointing wraps.
        self.block_classes = tuple(getattr(hf, "_no_split_modules", None) or ())
        self.block_size = int(getattr(hf.config, "max_position_embeddings", 0) or 0)
        # A classification head is new over the pretrained body: LoRA trains it in full.
        self.fresh_head = "hf.score" if head == "sequence_classification" else None

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, head_loss=None
    ):
        if self.head == "sequence_classification":
            return self.hf(input_ids=input_ids, use_cache=False).logits
        if head_loss is not None:
            return self._head_loss(input_ids, position_ids, head_loss)
        return self.hf(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits

    def _head_loss(self, input_ids, position_ids, head_loss) -> torch.Tensor:
        """task.chunked_loss: the base model's last hidden states and the output layer's
        weight to `head_loss`, never the logits, as transformers' causal-LM forward computes
        them (`lm_head(base(...)[0])`) for every model but those that change the logits after
        the head, refused by name. Inside this forward, so FSDP has gathered the head."""
        why = self.head_loss_refusal()
        if why:
            raise UserError(why)
        base = getattr(self.hf, getattr(self.hf, "base_model_prefix", ""), None)
        head = self.hf.get_output_embeddings()
        out = base(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return head_loss(out[0], *output_layer(head, f"{type(self.hf).__name__}'s output layer"))

    def head_loss_refusal(self) -> str | None:
        """Why this model cannot take `head_loss` (task.chunked_loss); None: it can. A model
        that changes the logits after the head (refused by name) or exposes no base model and
        output layer."""
        config = self.hf.config
        for key in LOGIT_CHANGES:
            if getattr(config, key, None) not in (None, 1, 1.0):
                return (
                    f"task.chunked_loss=true with model.path={self.path}: this "
                    f"{config.model_type} model's config sets {key}={getattr(config, key)}, "
                    "which changes the logits after the output layer, and the chunked loss "
                    "computes the logits from the output layer alone. Set "
                    "`task.chunked_loss=false` for this model."
                )
        base = getattr(self.hf, getattr(self.hf, "base_model_prefix", ""), None)
        if base is None or self.hf.get_output_embeddings() is None:
            return (
                f"task.chunked_loss=true with model.path={self.path}: transformers' "
                f"{type(self.hf).__name__} exposes no base model and output layer to compute "
                "the loss from. Set `task.chunked_loss=false` for this model."
            )
        return None

    @property
    def stop_token_ids(self) -> list[int]:
        """The ids the folder's generation_config.json ends a turn on (`eos_token_id`, an id or
        a list: a chat model's end-of-turn token is often there, not in the tokenizer)."""
        config = getattr(self.hf, "generation_config", None)
        ids = getattr(config, "eos_token_id", None)
        ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
        return [int(i) for i in ids]

    @torch.no_grad()
    def generate_ids(
        self,
        ids: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float,
        top_k: int | None,
        top_p: float,
        eos_token_id: int | list[int] | None,
        attention_mask: torch.Tensor | None = None,
        repeat: int = 1,
    ) -> torch.Tensor:
        """transformers' own generate (a KV cache, stopping on `eos_token_id`: one id or a list,
        each row at the first of them); seeded by the caller through torch's global generator.
        `attention_mask`: 0 on left padding (a batch of prompts of different lengths); None:
        every token real. `repeat` > 1: each prompt's rows `repeat` times in a row (a GRPO
        group), its prefill computed once (`_shared_prefill`). Returns the prompts (repeated)
        and their completions."""
        sampling = temperature > 0
        pad = eos_token_id[0] if isinstance(eos_token_id, list | tuple) else eos_token_id
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask
        cache = self._shared_prefill(ids, mask, repeat) if repeat > 1 else {}
        return self.hf.generate(
            input_ids=ids.repeat_interleave(repeat, 0),
            attention_mask=mask.repeat_interleave(repeat, 0),
            max_new_tokens=max_new_tokens,
            do_sample=sampling,
            temperature=temperature if sampling else None,
            top_k=(top_k or None) if sampling else None,
            top_p=top_p if sampling else None,
            eos_token_id=eos_token_id,
            pad_token_id=pad,
            use_cache=True,
            **cache,
        )

    def _shared_prefill(self, ids: torch.Tensor, mask: torch.Tensor, repeat: int) -> dict:
        """generate's cache argument holding each prompt's KV cache but its last token's,
        computed once and repeated to its rows (`batch_repeat_interleave`, DynamicCache's):
        generate then runs the last token on each row and samples on, as it would have from
        the repeated prompts (the same tokens for a seed, up to float rounding). A model whose
        cache cannot be repeated, or one-token prompts: {} (generate prefills every row)."""
        if ids.shape[1] < 2:
            return {}
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # left padding: as generate's
        out = self.hf(input_ids=ids[:, :-1], attention_mask=mask[:, :-1],
                      position_ids=positions[:, :-1], use_cache=True)  # fmt: skip
        key = "cache" if "cache" in out else "past_key_values"  # (transformers 5's name first)
        cache = out.get(key)
        if cache is None or not hasattr(cache, "batch_repeat_interleave"):
            return {}
        cache.batch_repeat_interleave(repeat)
        return {key: cache}

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, str]:
        """The tensor-parallel plan the model declares for itself: transformers' own
        `base_model_tp_plan` (its decoder layers' projections, colwise then rowwise), named from
        this wrapper (`hf.<base model>.layers.*...`). Embeddings and the head stay whole."""
        if sequence_parallel:
            raise UserError(
                "strategy.sequence_parallel=true with model=hf is not supported: the plan a "
                "Hugging Face model declares shards its projections only. Set "
                "`strategy.sequence_parallel=false`."
            )
        plan = getattr(self.hf.config, "base_model_tp_plan", None) or {}
        prefix = getattr(self.hf, "base_model_prefix", "")
        base = f"hf.{prefix}." if prefix and hasattr(self.hf, prefix) else "hf."
        return {f"{base}{pattern}": kind for pattern, kind in plan.items()}


def hf_model(
    *,
    path: str,
    head: str = "causal_lm",
    pretrained: bool = True,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    num_classes: int = 0,
    name: str = "hf",
    liger: bool = False,
) -> HFModel:
    """The model of the folder `path` with the chosen head, in `dtype` (the run's parameters).

    Long because its signature lists the option's keys, one a line, and each of transformers'
    steps (the config, the head, the weights) has its own refusal naming the key."""
    if head not in HEADS:
        raise UserError(f"model.head={head}: must be one of {', '.join(HEADS)}.")
    folder = model_folder(path)
    tf = _transformers()
    common = {"local_files_only": True, "trust_remote_code": False}
    try:
        config = tf.AutoConfig.from_pretrained(folder, **common)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(
            f"model.path={path}: transformers could not read its config.json ("
            f"{' '.join(str(err).split())[:300]}). Give {LAYOUT}."
        ) from None
    if liger:  # before the model is built: Liger patches transformers' module classes
        apply_liger(getattr(config, "model_type", None))
    kwargs: dict = {"attn_implementation": attn_implementation}
    auto = tf.AutoModelForCausalLM
    if head == "causal_lm":
        _check_causal(config, path)
    if head == "sequence_classification":
        if num_classes < 2:
            raise UserError(
                "model.head=sequence_classification needs the data's number of classes (at "
                "least 2): train it with task=classification on a labelled text data set."
            )
        auto = tf.AutoModelForSequenceClassification
        config.num_labels = num_classes
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = getattr(config, "eos_token_id", None) or 0
    try:
        if pretrained:
            _check_weights(folder, "model.path")
            hf, info = auto.from_pretrained(
                folder, config=config, dtype=dtype, use_safetensors=True, output_loading_info=True,
                **common, **kwargs,
            )  # fmt: skip
            if head == "causal_lm":
                _check_head(info, config, path)
        else:
            hf = auto.from_config(config, dtype=dtype, **kwargs).to(dtype)
    except UserError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise UserError(
            f"model.path={path}: transformers could not build the model "
            f"({type(err).__name__}: {' '.join(str(err).split())[:300]}). Check that the folder "
            f"is {LAYOUT}, written by a transformers version that knows model_type="
            f"{getattr(config, 'model_type', '?')}."
        ) from None
    return HFModel(hf, str(folder), head)


# The keys a config.json gives the model's context by: Llama's, Qwen's, Mistral's, Gemma's, ...;
# GPT-2's; a few others'. The first one present counts.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def prepare_config(cfg: DictConfig) -> None:
    """In the launching process, before config.yaml is written: rows longer than the folder's
    context (`dataset.max_length` above config.json's max_position_embeddings) would index
    past the model's positions, or run it at lengths it never saw. They are cut to the context,
    in one warning that names both numbers (the config.yaml written records what trains). Read
    from config.json as JSON: no transformers import in the launching process. Shard sets
    (`dataset.remote`) fixed their length when written, so they are left as they are."""
    if OmegaConf.is_missing(cfg.model, "path") or "remote" in cfg.dataset:
        return
    length, path = cfg.dataset.get("max_length"), cfg.model.get("path")
    if not isinstance(length, int) or not path:
        return
    config = Path(str(path)).expanduser() / "config.json"
    try:
        values = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return  # the build names what is wrong with the folder
    key = next((k for k in CONTEXT_KEYS if isinstance(values.get(k), int)), None)
    if key is None or length <= values[key]:
        return
    context = values[key]
    cfg.dataset.max_length = context
    log.warning(
        "dataset.max_length=%d is longer than the model's context (%s=%d in %s): rows are cut "
        "to %d tokens, dataset.max_length=%d. Set `dataset.max_length=%d` (or less) yourself to "
        "silence this, or fine-tune a model with a longer context",
        length, key, context, config, context, context, context,
    )  # fmt: skip


hf_model.prepare_config = prepare_config  # type: ignore[attr-defined]


def apply_liger(model_type: str | None, kernels=None) -> str:
    """`model.liger=true`: Liger's `apply_liger_kernel_to_<model_type>` (RMSNorm, RoPE and the
    SwiGLU / GeGLU MLP as Triton kernels; transformers' classes of that model type replaced, so
    the model built next uses them). Its cross-entropy and fused linear cross-entropy stay
    off: the task computes the loss from the logits (task.chunked_loss uses Liger's fused
    loss itself). `kernels`: the module holding the apply functions (liger_kernel.transformers;
    a test passes its own). Returns the function's name."""
    if model_type not in LIGER_MODEL_TYPES:
        raise UserError(
            f"model.liger=true: the model is model_type={model_type}, and accel-train applies "
            f"Liger's kernels to model types {', '.join(LIGER_MODEL_TYPES)} only. Set "
            "`model.liger=false` for this model."
        )
    if kernels is None:
        try:
            import liger_kernel.transformers as kernels
        except ImportError as err:
            raise UserError(
                f"model.liger=true: liger_kernel could not be imported ({err}). Install it: "
                "`pip install liger-kernel` (CUDA machines), or set `model.liger=false`."
            ) from None
    name = f"apply_liger_kernel_to_{model_type}"
    getattr(kernels, name)(rope=True, rms_norm=True, cross_entropy=False,
                           fused_linear_cross_entropy=False)  # fmt: skip
    log.info("model.liger: %s (RMSNorm, RoPE, MLP)", name)
    return name


def load_tokenizer(path: str, key: str = "dataset.tokenizer", chat_template: str | None = None):
    """The tokenizer of a model folder (its tokenizer.json / tokenizer_config.json and chat
    template), offline and without code from the folder. `chat_template`: a Jinja file whose
    template replaces the folder's (`dataset.chat_template`: a base model's folder has none)."""
    folder = model_folder(path, key)
    tf = _transformers()
    try:
        tok = tf.AutoTokenizer.from_pretrained(
            folder, local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(
            f"{key}={path}: transformers could not read a tokenizer there "
            f"({' '.join(str(err).split())[:300]}). The folder needs tokenizer.json and "
            "tokenizer_config.json (written by the tokenizer's save_pretrained)."
        ) from None
    if chat_template:
        tok.chat_template = read_chat_template(chat_template)
    return tok


def read_chat_template(path: str) -> str:
    """dataset.chat_template: a Jinja template as text (rendered by transformers' sandboxed
    Jinja environment, which runs no Python from it)."""
    file = Path(str(path)).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        why = getattr(err, "strerror", None) or err
        raise UserError(
            f"dataset.chat_template={path}: cannot be read ({why}). Give a UTF-8 Jinja file, "
            "e.g. a chat model's chat_template.jinja."
        ) from None
    if "messages" not in text:
        raise UserError(
            f"dataset.chat_template={path}: this file does not read `messages`, so it is not a "
            "chat template (a Jinja template that loops over `messages`, as in a chat model's "
            "chat_template.jinja)."
        )
    _check_jinja(text, file, path)
    return text


def _check_jinja(text: str, file: Path, path: str) -> None:
    """The template parsed now, as transformers' Jinja environment will compile it: a syntax
    error named by the file and its line, not by the record that first renders it."""
    import jinja2  # transformers' own dependency, for chat templates (the hf extra)
    from jinja2.ext import Extension, loopcontrols

    class Generation(Extension):  # transformers' `{% generation %}` tag, parsed only
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    try:
        jinja2.Environment(extensions=[loopcontrols, Generation]).parse(text)
    except jinja2.TemplateSyntaxError as err:
        line = (text.splitlines() or [""])[max(err.lineno, 1) - 1].strip()
        raise UserError(
            f"dataset.chat_template={path}: {file}:{err.lineno}: a Jinja syntax error, "
            f"{err.message} (the line: {line[:160]!r}). Fix the template (chat templates are "
            "Jinja: https://huggingface.co/docs/transformers/chat_templating)."
        ) from None
