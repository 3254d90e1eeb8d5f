"""Benchmark evaluation with lm-evaluation-harness and generation samples during training: a
tiny LoRA fine-tune through the real CLI with trainer.sample_every_n_steps and
trainer.harness_every_n_steps on, then `accel-eval harness.tasks=[...]` on its checkpoint and on
the base folder, over the offline example task shipped in the package (a multiple-choice and a
generate-until task over local JSONL files); in-process, the LM wrapper's log-likelihoods
against the model's own, and the refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import check_ok, read_jsonl
from hf_fixtures import write_records, write_tiny_llama
from omegaconf import OmegaConf

from accel_train.config.text_checks import check_text_in_training
from accel_train.errors import UserError
from accel_train.models.harness import EXAMPLE_TASKS, HarnessTasks, import_harness
from accel_train.models.harness_lm import harness_lm
from accel_train.models.hf import hf_model, load_tokenizer
from accel_train.train.harness_eval import check_sources, evaluate_harness

TASKS = EXAMPLE_TASKS  # the package's own (relative data_files: resolved from there)

SFT = [
    "+experiment=sft_lora",
    "dataset.max_length=64",
    "lora.rank=4",
    "lora.dropout=0.1",  # the run's random state in use: sampling must leave it alone
    "loader.batch_size=4",
    "trainer.max_epochs=1",
    "trainer.max_steps=4",
    "trainer.log_every_n_steps=1",
    "trainer.progress=none",
    "logger=[csv,tensorboard]",
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    write_tiny_llama(root / "llama")
    write_records(root / "train.jsonl", 16)
    write_records(root / "val.jsonl", 4)
    return root


def test_samples_and_harness_in_training_then_accel_eval_on_run_and_base(root, run_cli_in):
    prompts = root / "prompts.jsonl"  # both record forms: a plain prompt and chat messages
    prompts.write_text(
        json.dumps({"prompt": "Say hello."})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Double a number."}]})
        + "\n"
    )
    run, plain = root / "run", root / "plain"
    data = [
        *SFT,
        f"model.path={root / 'llama'}",
        f"dataset.path={root / 'train.jsonl'}",
        f"dataset.val_path={root / 'val.jsonl'}",
    ]
    args = [
        *data,
        "trainer.sample_every_n_steps=2",
        f"trainer.sample_prompts={prompts}",
        "trainer.sample_max_new_tokens=6",
        "trainer.sample_temperature=0.8",
        "trainer.harness_every_n_steps=4",
        "trainer.harness.tasks=[tiny_offline]",
        f"trainer.harness.include_path={TASKS}",
        f"hydra.run.dir={run}",
    ]
    proc = run_cli_in(args, root)
    check_ok(proc)
    check_ok(run_cli_in([*data, "logger=none", f"hydra.run.dir={plain}"], root))
    out = proc.stdout + proc.stderr
    # Each round's first sample on the console; samples.jsonl named once (issue 47).
    said = [line for line in out.splitlines() if " sample" in line and "'Say hello.' -> " in line]
    assert len(said) == 2 and "step 2 sample (every prompt's" in said[0], said
    assert out.count(str(run / "samples.jsonl")) == 1
    # The parameter line splits LoRA's trainable adapters from the frozen base (as PEFT does).
    assert re.search(r"\([\d,]+ parameters: [\d,]+ trainable \(\d+\.\d\d%\), [\d,]+ frozen\)", out)
    # sft_lora clips at 1.0 (TRL's max_grad_norm): train/grad_norm at each logging step.
    norms = [m["train/grad_norm"] for m in read_jsonl(run / "metrics.jsonl") if "train/loss" in m]
    assert len(norms) == 4 and all(n > 0 for n in norms)

    def losses(run_dir: Path) -> list[float]:
        return [m["train/loss"] for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m]

    assert losses(run) == losses(plain) and len(losses(run)) == 4  # trains the same
    rows = read_jsonl(run / "samples.jsonl")
    assert [(r["step"], r["prompt"]) for r in rows] == [
        (2, "Say hello."), (2, "Double a number."), (4, "Say hello."), (4, "Double a number."),
    ]  # fmt: skip
    assert all(isinstance(r["completion"], str) for r in rows)
    logged = [m for m in read_jsonl(run / "metrics.jsonl") if "harness/tiny_choice/acc" in m]
    assert [m["step"] for m in logged] == [4]
    # 4 choices of 3 options, 3 exact-match questions: the scores are such fractions
    assert logged[0]["harness/tiny_choice/acc"] * 4 % 1 == 0
    assert logged[0]["harness/tiny_answer/exact_match"] * 3 % 1 == 0
    csv = (run / "metrics.csv").read_text()
    assert "harness/tiny_choice/acc" in csv and "harness/tiny_answer/exact_match" in csv
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard")).Reload()
    assert any(t.startswith("samples") for t in events.Tags()["tensors"])

    # No include_path: the package's example task, as docs/fine-tuning.md prints the commands.
    harness = ["harness.tasks=[tiny_offline]"]
    base_dir = root / "elsewhere"
    base_dir.mkdir()
    for source, cwd, out in (
        (f"ckpt_path={run / 'checkpoints' / 'last.pt'}", root, run / "harness_last.json"),
        (f"model_path={root / 'llama'}", base_dir, base_dir / "harness_llama.json"),
    ):
        proc = run_cli_in([source, *harness], cwd, prog="accel-eval")
        check_ok(proc)
        assert re.search(r"\|\s*-?\s*tiny_choice\s*\|.*\|acc\s*\|", proc.stdout), proc.stdout
        written = json.loads(out.read_text())
        assert set(written["results"]) >= {"tiny_choice", "tiny_answer"}
        assert "acc,none" in written["results"]["tiny_choice"]
        assert "exact_match,none" in written["results"]["tiny_answer"]


def test_loglikelihood_is_the_models_own(root):
    from lm_eval.api.instance import Instance

    import_harness("harness.tasks")
    model = hf_model(path=str(root / "llama")).eval()
    tok = load_tokenizer(str(root / "llama"))
    pairs = [("Reverse a list.", "\ndef rev(xs):"), ("Add two numbers.\n", "print('hello')")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]

    def make(batch_size):
        return harness_lm(model, None, tok, torch.device("cpu"), max_length=256,
                          batch_size=batch_size)  # fmt: skip

    one_by_one = make(1).loglikelihood(requests)
    batched = make(8).loglikelihood(requests)  # right-padded rows
    for (context, continuation), (score, greedy), (padded, _) in zip(
        pairs, one_by_one, batched, strict=True
    ):
        ctx, cont = _encode_pair(tok, context, continuation)
        with torch.no_grad():
            logits = model.hf(input_ids=torch.tensor([ctx + cont])).logits[0]
        logprobs = torch.log_softmax(logits.float(), -1)[len(ctx) - 1 : -1]
        target = torch.tensor(cont)
        expected = logprobs.gather(1, target[:, None]).sum()
        assert score == float(expected)
        assert greedy == bool((logprobs.argmax(-1) == target).all())
        assert abs(padded - score) < 1e-4
    # rolling: every token of a document given the ones before it, after the prefix token
    text = "def rev(xs):\n    return xs[::-1]"
    (rolling,) = make(8).loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    ids = [tok.eos_token_id, *tok.encode(text, add_special_tokens=False)]
    with torch.no_grad():
        logits = model.hf(input_ids=torch.tensor([ids])).logits[0, :-1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids[1:])[:, None])
    assert abs(rolling - float(expected.sum())) < 1e-4
    # harness.chat=true: the harness's turns rendered by the folder's chat template
    chat = make(8).apply_chat_template([{"role": "user", "content": "Say hello."}])
    assert chat == "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"


def _encode_pair(tok, context: str, continuation: str):
    """The harness's split (TemplateLM._encode_pair): trailing spaces of the context move to
    the continuation, the whole encoded once."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx) :]


def test_refusals(tmp_path, monkeypatch, compose_cfg):
    with pytest.raises(UserError, match="nope is not a task"):
        HarnessTasks(["nope"], str(TASKS), "harness.tasks")
    # a task whose data is not local: one paragraph naming it, no download
    (tmp_path / "remote.yaml").write_text(
        "task: remote_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        "    test: not_here.jsonl\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: q\ndoc_to_choice: ['a']\ndoc_to_target: 0\n"
    )
    with pytest.raises(UserError, match="remote_task could not load its data offline"):
        HarnessTasks(["remote_task"], str(tmp_path), "harness.tasks")
    ecfg = OmegaConf.create({"ckpt_path": "a.pt", "model_path": "base", "harness": {"tasks": []}})
    with pytest.raises(UserError, match="both given"):
        check_sources(ecfg)
    # a file accel-eval did not write is never replaced
    mine = tmp_path / "mine.json"
    mine.write_text("{}")
    ecfg = OmegaConf.create(
        {"ckpt_path": None, "model_path": "base", "out_path": str(mine),
         "harness": {"tasks": ["tiny_offline"], "include_path": str(TASKS), "limit": None,
                     "num_fewshot": None, "batch_size": 8}}
    )  # fmt: skip
    with pytest.raises(UserError, match="not an accel-eval harness result"):
        evaluate_harness(ecfg, torch.device("cpu"))
    assert mine.read_text() == "{}"
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # not installed
    with pytest.raises(UserError, match=r"pip install 'accel-train\[eval\]'"):
        import_harness("harness.tasks")
    # a run on a token folder (model=gpt) has no model folder's tokenizer to generate with
    cfg = compose_cfg(["+experiment=gpt_char", "trainer.sample_every_n_steps=5",
                       "trainer.sample_prompts=[hi]"])  # fmt: skip
    with pytest.raises(UserError, match="task.sample_lines"):
        check_text_in_training(cfg)
    sft = ["+experiment=sft_lora", "model.path=m", "dataset.path=d.jsonl"]
    for extra, refused in (
        (["strategy=tp", "lora.rank=0", "trainer.sample_prompts=[hi]"], "tensor-parallel"),
        (["trainer.sample_prompts=[hi]", "trainer.sample_temperature=-1"], "must be >= 0"),
        (["trainer.harness_every_n_steps=5", "trainer.sample_every_n_steps=0"], "tasks is empty"),
    ):
        cfg = compose_cfg([*sft, "trainer.sample_every_n_steps=5", *extra])
        with pytest.raises(UserError, match=refused):
            check_text_in_training(cfg)


def test_sample_tables_reach_mlflow_and_wandb(tmp_path, monkeypatch):
    """MetricsLogger.log_table: MLflow's table artifact gathers every step's rows; W&B gets a
    wandb.Table per step (offline)."""
    from mlflow.tracking import MlflowClient

    from accel_train.loggers import MetricsLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    run.mkdir()
    loggers = {"mlflow": {"experiment_name": "samples"}, "wandb": {"mode": "offline"}}
    logger = MetricsLogger(run, loggers, run_config={"paths": {"log_dir": str(tmp_path)}})
    columns = ["step", "prompt", "completion"]
    logger.log_table("samples", columns, [[1, "Say hello.", "print('hi')\n"]], 1)
    logger.log_table("samples", columns, [[2, "Say hello.", "hi | there"]], 2)
    logger.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    run_id = (run / ".mlflow_run_id").read_text().strip()
    table = json.loads(
        Path(client.download_artifacts(run_id, "samples.json", str(tmp_path))).read_text()
    )
    assert table == {
        "columns": columns,
        "data": [[1, "Say hello.", "print('hi')\n"], [2, "Say hello.", "hi | there"]],
    }
    tables = list((run / "wandb").glob("offline-run-*/files/media/table/samples_*.table.json"))
    assert len(tables) == 2
    assert {json.loads(t.read_text())["data"][0][0] for t in tables} == {1, 2}
