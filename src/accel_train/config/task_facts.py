"""What the config checks read of a built-in task, as plain data on a class that imports no
torch: the task classes (accel_train/tasks/) inherit these, so each fact is written once, and
the checks (config/facts.task_class, validation_metrics) read them here, before anything imports
torch (a refused config then costs well under a CPU second; BENCHMARKS.md section 38).

Tasks whose refusal needs more than the config (task=preference and task=grpo ask the strategy
classes) are not listed: their own class is imported, torch with it. So is a task of the user's.
(See tasks/base.py's docstring for what each fact means.)
"""

from __future__ import annotations

from omegaconf import DictConfig


class TaskFacts:
    """What every task declares; the defaults of accel_train.tasks.Task."""

    name = "task"
    uses_loss_group = False
    per_sample_loss = False
    class_logits = False
    labelled_data = False
    pipeline = False
    # Takes data/images/batch_mix.py's (x, soft targets, labels) training batches.
    soft_targets = False
    generates_text = False  # accel-sample may sample it: token ids in, next-token logits out
    table_names: tuple[str, ...] = ()  # tables() kept in <name>.jsonl in the run dir

    @classmethod
    def metric_modes(cls, cfg: DictConfig) -> dict[str, str]:
        """The metrics validation logs (without the `val/` prefix) -> min or max."""
        return {"loss": "min", **{str(k): str(v) for k, v in (cfg.get("metrics") or {}).items()}}

    @classmethod
    def config_refusal(cls, cfg: DictConfig) -> str | None:
        """Why this run's other choices (model, strategy, ...) cannot work with this task, in
        one paragraph naming the keys; None: they can. Read by the config checks before
        anything is built."""
        return None


class Classification(TaskFacts):
    name = "classification"
    uses_loss_group = True
    per_sample_loss = True
    class_logits = True
    labelled_data = True
    pipeline = True
    soft_targets = True

    @classmethod
    def metric_modes(cls, cfg: DictConfig) -> dict[str, str]:
        modes = {"acc": "max", "loss": "min"}
        top_k = cfg.get("top_k") if cfg.get("top_k") is not None else (1, 5)  # (None: maybe 5)
        modes.update({f"acc_top{k}": "max" for k in top_k if k != 1})
        return modes


class Regression(TaskFacts):
    name = "regression"
    per_sample_loss = True

    @classmethod
    def metric_modes(cls, cfg: DictConfig) -> dict[str, str]:
        return {"loss": "min", "mse": "min", "mae": "min"}


class Segmentation(TaskFacts):
    name = "segmentation"

    @classmethod
    def metric_modes(cls, cfg: DictConfig) -> dict[str, str]:
        # (val/dice/<class> too, named from the data: declared by the task's setup.)
        return {"loss": "min", "dice": "max"}


class LanguageModel(TaskFacts):
    name = "language_model"
    generates_text = True
    # strategy=pipeline: the last stage computes loss_fn on its micro-batches' logits. Each
    # micro-batch's mean is weighted by its windows, which is the mean over the tokens as long
    # as every window counts the same number (no ignore_index targets).
    pipeline = True

    @classmethod
    def metric_modes(cls, cfg: DictConfig) -> dict[str, str]:
        return {"loss": "min", "ppl": "min"}


class Custom(TaskFacts):
    name = "custom"


class ModelLoss(TaskFacts):
    name = "model_loss"


# A built-in task's `_target_` -> its facts (tests/test_architecture.py checks that each task
# class there subclasses its facts and adds no fact of its own).
BUILTIN_TASKS: dict[str, type[TaskFacts]] = {
    "accel_train.tasks.classification.Classification": Classification,
    "accel_train.tasks.regression.Regression": Regression,
    "accel_train.tasks.segmentation.Segmentation": Segmentation,
    "accel_train.tasks.language_model.LanguageModel": LanguageModel,
    "accel_train.tasks.custom.Custom": Custom,
    "accel_train.tasks.model_loss.ModelLoss": ModelLoss,
}
