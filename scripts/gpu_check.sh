#!/usr/bin/env bash
# The GPU paths, run on a GPU (issue 22, section 6): each check is one real accel-train run (or
# accel-report), timed, its outcome and samples/s written to a report with the GPU's name.
#
#   scripts/gpu_check.sh                        # tiny synthetic digits, short runs (minutes)
#   DATA_DIR=/data scripts/gpu_check.sh         # real MNIST under $DATA_DIR/MNIST
#   FULL=1 DATA_DIR=/data scripts/gpu_check.sh  # the whole mnist_amp recipe per check
#   OUT=/tmp/gpu_check STEPS=300 scripts/gpu_check.sh
#   GPT_DATA=data/mytext scripts/gpu_check.sh   # the GPT recipe's token folder (else
#                                               # $DATA_DIR/pycode, else the docs tokenized)
#
# Checks: mnist_amp in fp16 (with its GradScaler) and in bf16; trainer.compile=true;
# loader=device and the torch loader with pinned memory and workers; FSDP2 on one GPU (a
# torchrun group of one, so the model really is sharded); the memory techniques (EMA,
# activation checkpointing, loader.batch_size=auto); accel-report; DDP over every GPU when more
# than one is visible; the GPT recipe once an experiment named *gpt* exists; photo-sized JPEGs
# (issue 38) through ResNet-50 in bf16 and channels_last, decoded by the loader workers
# (dataset.decode=cpu) and by nvJPEG on the GPU (decode=gpu): images/s and the data-wait share;
# the chunked loss (issue 41) against the plain one on the GPT recipe (Liger's kernel if installed).
#   PHOTO_DIR=/data/imagenet scripts/gpu_check.sh  # a real ImageFolder tree for that check (else
#                                                  # 2,000 generated 400-560 px JPEGs)
#
# Long context (issue 41): packed GPT rows through FlexAttention against the records alone,
# activation offloading's peak memory (scripts/gpu_long_context.py), a packed, checkpointed and
# offloaded GPT run, and model=hf with model.liger=true when liger-kernel is installed.
#
# GPU_CHECK_ON_CPU=1 runs the same commands on the CPU: a smoke test of the script itself.
#
# Exit: 0 when every check passed, 1 when one failed (the report says which, each run dir keeps
# its logs). Without CUDA it says so and exits 0 at once (REQUIRE_GPU=1: exit 3 instead), so it
# can be smoke-tested anywhere.
set -uo pipefail

ACCEL_TRAIN=${ACCEL_TRAIN:-accel-train}
ACCEL_REPORT=${ACCEL_REPORT:-accel-report}
ACCEL_DATA=${ACCEL_DATA:-accel-data}
PYTHON=${PYTHON:-python}
STEPS=${STEPS:-200}
OUT=${OUT:-outputs/gpu_check/$(date +%Y-%m-%d_%H-%M-%S)}

if ! gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null); then
    echo "gpu_check: $PYTHON cannot import torch: activate the accel-train environment first" >&2
    exit 2
fi
if [ "${GPU_CHECK_ON_CPU:-0}" = 1 ]; then
    # Smoke test of this script's own commands without a GPU: every check on the CPU (slow,
    # and precision=fp16 has no GradScaler there); not a GPU check.
    gpus=1
    cpu=(trainer.device=cpu)
else
    cpu=()
fi
if [ "$gpus" -eq 0 ]; then
    echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing to check"
    if [ "${REQUIRE_GPU:-0}" = 1 ]; then exit 3; fi
    exit 0
fi

mkdir -p "$OUT"
REPORT="$OUT/gpu_check.md"
if [ -n "${DATA_DIR:-}" ]; then
    data=("paths.data_dir=$DATA_DIR" dataset.download=false)
    data_note="MNIST from $DATA_DIR"
else
    data=(dataset=synthetic dataset.num_train=8192 dataset.num_test=2048)
    data_note="synthetic digits (8192 train, 2048 test); set DATA_DIR for real MNIST"
fi
if [ "${FULL:-0}" = 1 ]; then
    length=()
    length_note="the whole recipe"
else
    length=("trainer.max_steps=$STEPS" trainer.target=null)
    length_note="$STEPS optimizer steps"
fi
common=(logger=none trainer.progress=none trainer.plot_curves=false "${cpu[@]}")

{
    echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    "$PYTHON" - <<'EOF'
import torch
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"- GPUs: {len(names)} x {', '.join(sorted(set(names)))}")
print(f"- torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"bf16 supported: {torch.cuda.is_bf16_supported()}")
EOF
    echo "- data: $data_note; length: $length_note"
    echo "- command per check: \`$ACCEL_TRAIN +experiment=mnist_amp ${data[*]} ${length[*]} ${common[*]} <overrides> hydra.run.dir=$OUT/<check>\`"
    echo
    echo "| check | overrides | result | wall s | train samples/s | best val acc | test acc |"
    echo "|---|---|---|---|---|---|---|"
} > "$REPORT"

failed=()

# summary.json fields for the report row ("-" where absent).
fields() {
    "$PYTHON" - "$1" <<'EOF'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    print("- | - | -"); sys.exit()
def f(key, fmt):
    v = s.get(key)
    return "-" if v is None else format(v, fmt)
print(f"{f('train_samples_per_s', ',.0f')} | {f('best_val_acc', '.4f')} | {f('test_acc', '.4f')}")
EOF
}

# check NAME SHOWN COMMAND...: run COMMAND (output to $OUT/NAME.log), time it, add a row to the
# report (SHOWN: the check's own overrides, for the report).
check() {
    local name=$1 shown=$2
    shift 2
    echo "gpu_check: $name ..."
    local start end status
    start=$(date +%s.%N)
    "$@" > "$OUT/$name.log" 2>&1
    status=$?
    end=$(date +%s.%N)
    local wall result
    wall=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
    if [ "$status" -eq 0 ]; then
        result="ok"
    else
        result="**FAILED** (exit $status, see $name.log)"
        failed+=("$name")
    fi
    echo "| $name | \`${shown//|/\\|}\` | $result | $wall | $(fields "$OUT/$name/summary.json") |" >> "$REPORT"
    echo "gpu_check: $name: $result (${wall} s)"
}

# train NAME OVERRIDES...: mnist_amp with the data, the length and the check's overrides.
train() {
    local name=$1
    shift
    check "$name" "$*" "$ACCEL_TRAIN" +experiment=mnist_amp "${data[@]}" "${length[@]}" "${common[@]}" \
        "$@" "hydra.run.dir=$OUT/$name"
}

train fp16_gradscaler precision=fp16
if [ -f "$OUT/fp16_gradscaler.log" ] && ! grep -q "float16 autocast + GradScaler" "$OUT/fp16_gradscaler.log"; then
    echo "| fp16_gradscaler | | **FAILED**: the log does not say float16 autocast + GradScaler | | | | |" >> "$REPORT"
    failed+=(fp16_gradscaler_no_scaler)
fi
train bf16 precision=bf16
train compile precision=bf16 trainer.compile=true
train device_loader precision=bf16 loader=device
train pinned_workers precision=bf16 loader=torch loader.pin_memory=true loader.num_workers=2
train fsdp_one_gpu precision=bf16 strategy=fsdp launcher=torchrun launcher.nproc_per_node=1
train memory_techniques precision=bf16 ema.enabled=true ema.warmup=true \
    activation_checkpointing.mode=full loader.batch_size=auto
check accel_report "--variants baseline,amp,bf16,compile,channels_last" "$ACCEL_REPORT" --repeats 1 --variants baseline,amp,bf16,compile,channels_last \
    --out "$OUT/accel_report" +experiment=mnist_amp "${data[@]}" "${length[@]}" "${common[@]}"
if [ "$gpus" -gt 1 ]; then
    train ddp_all_gpus precision=bf16 strategy=ddp launcher.nproc_per_node=auto
else
    echo "| ddp_all_gpus | | skipped: 1 GPU visible | | | | |" >> "$REPORT"
fi

# The GPT recipe: run once an experiment whose name holds "gpt" exists (issue 22 names it; it
# has its own data and model, so none of the MNIST overrides above).
gpt=$("$PYTHON" -c '
from accel_train.config import CONFIG_DIR
print(" ".join(sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*gpt*.yaml"))))')
if [ -n "$gpt" ]; then
    # Its token folder: $GPT_DATA, else $DATA_DIR/pycode, else this repo's docs tokenized by
    # characters (accel-data tokenize, itself a check).
    if [ -z "${GPT_DATA:-}" ] && [ -n "${DATA_DIR:-}" ] && [ -f "$DATA_DIR/pycode/meta.json" ]; then
        GPT_DATA=$DATA_DIR/pycode
    fi
    if [ -z "${GPT_DATA:-}" ]; then
        here=$(cd "$(dirname "$0")/.." && pwd)
        cat "$here"/README.md "$here"/docs/*.md > "$OUT/gpt_text.txt"
        GPT_DATA=$OUT/gpt_tokens
        check tokenize "input=gpt_text.txt tokenizer=char" "$ACCEL_DATA" tokenize \
            "input=$OUT/gpt_text.txt" "out=$GPT_DATA" tokenizer=char "hydra.run.dir=$OUT/tokenize"
    fi
    for recipe in $gpt; do
        check "gpt_$recipe" "+experiment=$recipe precision=bf16" "$ACCEL_TRAIN" "+experiment=$recipe" \
            "dataset.path=$GPT_DATA" precision=bf16 "${length[@]}" "${common[@]}" \
            "hydra.run.dir=$OUT/gpt_$recipe"
    done
    # Asynchronous checkpoint saves (issue 29): dcp/thread writes overlapping training on the
    # GPU, staged to pinned memory; the run must log checkpoint/blocked_s per save.
    check async_save "+experiment=gpt_char checkpoint.async_save=true trainer.ckpt_every_n_steps=20" \
        "$ACCEL_TRAIN" +experiment=gpt_char "dataset.path=$GPT_DATA" precision=bf16 \
        checkpoint.async_save=true trainer.ckpt_every_n_steps=20 "${length[@]}" "${common[@]}" \
        "hydra.run.dir=$OUT/async_save"
    if [ -f "$OUT/async_save/metrics.jsonl" ] && ! grep -q "checkpoint/blocked_s" "$OUT/async_save/metrics.jsonl"; then
        echo "| async_save | | **FAILED**: no checkpoint/blocked_s in metrics.jsonl | | | | |" >> "$REPORT"
        failed+=(async_save_no_metric)
    fi
    # The chunked loss (issue 41): gpt_char in bf16, 20 steps with the plain loss and with
    # task.chunked_loss=true; the first 5 training losses must agree (bf16's precision), and the
    # log names the path taken (Liger's fused kernel when liger-kernel is installed).
    for chunked in false true; do
        check "gpt_chunked_loss_$chunked" "+experiment=gpt_char task.chunked_loss=$chunked" \
            "$ACCEL_TRAIN" +experiment=gpt_char "dataset.path=$GPT_DATA" precision=bf16 \
            "task.chunked_loss=$chunked" trainer.max_steps=20 trainer.log_every_n_steps=1 \
            "${common[@]}" "hydra.run.dir=$OUT/gpt_chunked_loss_$chunked"
    done
    if ! verdict=$("$PYTHON" - "$OUT" 2>&1 <<'EOF'
import json, sys
def losses(name):
    rows = [json.loads(line) for line in open(f"{sys.argv[1]}/gpt_chunked_loss_{name}/metrics.jsonl")]
    return [r["train/loss"] for r in rows if "train/loss" in r][:5]
try:
    plain, chunked = losses("false"), losses("true")
    log = open(f"{sys.argv[1]}/gpt_chunked_loss_true.log").read()
except OSError as err:
    sys.exit(f"no metrics ({err})")
path = "Liger" if "Liger's fused linear cross-entropy" in log else "PyTorch chunks"
far = [(a, b) for a, b in zip(plain, chunked) if abs(a - b) > 2e-2 * abs(a)]
if len(plain) < 5 or len(chunked) != len(plain) or far:
    sys.exit(f"{path}: losses differ: plain {plain}, chunked {chunked}")
print(f"{path}: the first 5 losses agree within 2 %")
EOF
    ); then
        verdict="**FAILED**: ${verdict:-the comparison did not run}"
        failed+=(gpt_chunked_loss_agreement)
    fi
    echo "| gpt_chunked_loss | plain vs chunked | $verdict | | | | |" >> "$REPORT"
    # Tensor parallelism over NCCL (issue 29): TP over 2 GPUs, FSDP x TP over 4.
    if [ "$gpus" -gt 1 ]; then
        check tp_two_gpus "+experiment=gpt_char strategy=tp launcher.nproc_per_node=2" \
            "$ACCEL_TRAIN" +experiment=gpt_char "dataset.path=$GPT_DATA" precision=bf16 \
            strategy=tp launcher.nproc_per_node=2 "${length[@]}" "${common[@]}" \
            "hydra.run.dir=$OUT/tp_two_gpus"
        # Context parallelism (issue 41): each row split over 2 GPUs, ring attention, FSDP over
        # dp_shard x cp; the loss curve must match the 1-GPU run's (the report's loss column).
        check cp_two_gpus "+experiment=gpt_char strategy=fsdp strategy.cp=2 launcher.nproc_per_node=2" \
            "$ACCEL_TRAIN" +experiment=gpt_char "dataset.path=$GPT_DATA" precision=bf16 \
            strategy=fsdp strategy.cp=2 launcher.nproc_per_node=2 "${length[@]}" "${common[@]}" \
            "hydra.run.dir=$OUT/cp_two_gpus"
    else
        echo "| tp_two_gpus | | skipped: 1 GPU visible | | | | |" >> "$REPORT"
        echo "| cp_two_gpus | | skipped: 1 GPU visible | | | | |" >> "$REPORT"
    fi
    if [ "$gpus" -gt 3 ]; then
        check fsdp_tp_four_gpus "+experiment=gpt_char strategy=fsdp strategy.tp=2 launcher.nproc_per_node=4" \
            "$ACCEL_TRAIN" +experiment=gpt_char "dataset.path=$GPT_DATA" precision=bf16 \
            strategy=fsdp strategy.tp=2 launcher.nproc_per_node=4 "${length[@]}" "${common[@]}" \
            "hydra.run.dir=$OUT/fsdp_tp_four_gpus"
    else
        echo "| fsdp_tp_four_gpus | | skipped: fewer than 4 GPUs visible | | | | |" >> "$REPORT"
    fi
    # The speed of each GPT recipe at its last logging step (issue 31: gpt2_small's MFU goal
    # is 40 % of the H100's 989 TFLOP/s dense bf16).
    {
        echo
        echo "| GPT recipe | MFU | TFLOP/s | samples/s | peak memory MiB |"
        echo "|---|---|---|---|---|"
        "$PYTHON" - "$OUT" $gpt <<'EOF'
import json, sys
out, recipes = sys.argv[1], sys.argv[2:]
for recipe in recipes:
    try:
        rows = [json.loads(line) for line in open(f"{out}/gpt_{recipe}/metrics.jsonl")]
    except OSError:
        print(f"| {recipe} | - | - | - | - |")
        continue
    last = next((r for r in reversed(rows) if "train/samples_per_s" in r), {})
    def f(key, fmt):
        return "-" if last.get(key) is None else format(last[key], fmt)
    print(f"| {recipe} | {f('train/mfu', '.1%')} | {f('train/tflops', '.1f')} | "
          f"{f('train/samples_per_s', ',.0f')} | {f('train/peak_mem_mb', ',.0f')} |")
EOF
    } >> "$REPORT"
else
    echo "| gpt | | skipped: no GPT recipe yet (configs/experiment/*gpt*.yaml) | | | | |" >> "$REPORT"
fi

# Long context (issue 41): packed rows through FlexAttention and activation offloading in one
# process (scripts/gpu_long_context.py: the same losses and gradients, less peak memory), then
# real runs on a tiny chat tokenizer and Llama written as the tests write them: the GPT on
# packed rows with every block checkpointed and offloaded, and model=hf with Liger's kernels.
if [ "${#cpu[@]}" -eq 0 ]; then
    repo=$(cd "$(dirname "$0")/.." && pwd)
    check long_context_kernels "scripts/gpu_long_context.py" "$PYTHON" "$repo/scripts/gpu_long_context.py"
    LC=$OUT/long_context
    "$PYTHON" - "$LC" "$repo/tests" <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from hf_fixtures import write_records, write_tiny_llama
root = Path(sys.argv[1])
write_tiny_llama(root / "llama")
write_records(root / "train.jsonl", 256)
write_records(root / "val.jsonl", 16)
EOF
    sft=(dataset=sft "dataset.path=$LC/train.jsonl" "dataset.val_path=$LC/val.jsonl"
         "dataset.tokenizer=$LC/llama" dataset.max_length=512 dataset.pack=true precision=bf16
         loader.batch_size=8 "${length[@]}" "${common[@]}")
    check packed_gpt_offload "model=gpt dataset=sft dataset.pack=true activation_checkpointing.mode=full activation_checkpointing.offload=true" \
        "$ACCEL_TRAIN" "${sft[@]}" model=gpt model.block_size=512 model.n_layer=4 model.n_head=4 \
        model.n_embd=256 activation_checkpointing.mode=full activation_checkpointing.offload=true \
        "hydra.run.dir=$OUT/packed_gpt_offload"
    if "$PYTHON" -c 'import liger_kernel' 2>/dev/null; then
        check hf_liger "model=hf (tiny Llama) model.liger=true dataset.pack=true" \
            "$ACCEL_TRAIN" "${sft[@]}" model=hf "model.path=$LC/llama" model.liger=true \
            "hydra.run.dir=$OUT/hf_liger"
    else
        echo "| hf_liger | | skipped: liger-kernel not installed (pip install liger-kernel) | | | | |" >> "$REPORT"
    fi
else
    echo "| long_context | | skipped: GPU_CHECK_ON_CPU (offloading and Liger are refused on the CPU) | | | | |" >> "$REPORT"
fi

# Photos at full size (issue 38): decode=cpu against decode=gpu on ResNet-50 (model=torchvision),
# bf16, channels_last, 224 px crops of whole photos.
if [ -z "${PHOTO_DIR:-}" ]; then
    PHOTO_DIR=$OUT/photos
    "$PYTHON" - "$PHOTO_DIR" "$(cd "$(dirname "$0")" && pwd)/bench" <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from image_loader import write_data  # 400-560 x 300-440 px, ~78 KB, 10 classes
write_data(Path(sys.argv[1]), 2000, 10)
EOF
fi
photo_model=(model=torchvision model.name=resnet50)
workers=$("$PYTHON" -c 'import os; print(max(2, min(16, len(os.sched_getaffinity(0)) - 2)))')
photos=(dataset=image_folder "dataset.root=$PHOTO_DIR" dataset.image_size=224 "${photo_model[@]}"
        precision=bf16 trainer.channels_last=true loader.batch_size=128 loader.pin_memory=true
        "loader.num_workers=$workers" "${length[@]}" "${common[@]}")
decodes=(cpu gpu)
if [ "${#cpu[@]}" -gt 0 ]; then decodes=(cpu); fi  # GPU_CHECK_ON_CPU: decode=gpu is refused there
for decode in "${decodes[@]}"; do
    check "photos_decode_$decode" "${photo_model[*]} dataset.decode=$decode (bf16, channels_last, $workers workers)" \
        "$ACCEL_TRAIN" "${photos[@]}" "dataset.decode=$decode" "hydra.run.dir=$OUT/photos_decode_$decode"
done
# The ViT fine-tuning recipe (issue 38) on the same photos: a vit_small_patch16_224 saved as timm
# saves it (random weights: the throughput and the recipe's switches are what is checked).
VIT_DIR=$OUT/vit_small_patch16_224
"$PYTHON" -c 'import sys, timm; from timm.models import save_for_hf; save_for_hf(timm.create_model("vit_small_patch16_224"), sys.argv[1], safe_serialization=True)' "$VIT_DIR"
check vit_finetune "+experiment=vit_finetune (bf16, $workers workers)" \
    "$ACCEL_TRAIN" +experiment=vit_finetune "model.weights=$VIT_DIR" +model.drop_path_rate=0.1 \
    "dataset.root=$PHOTO_DIR" loader.batch_size=128 "loader.num_workers=$workers" scheduler.warmup_steps=10 \
    "${length[@]}" "${common[@]}" "hydra.run.dir=$OUT/vit_finetune"
{
    echo
    echo "| photos, ${photo_model[*]} | train images/s | data-wait share (last log) |"
    echo "|---|---|---|"
    "$PYTHON" - "$OUT" <<'EOF'
import json, sys
for decode in ("cpu", "gpu"):
    try:
        rows = [json.loads(line) for line in open(f"{sys.argv[1]}/photos_decode_{decode}/metrics.jsonl")]
    except OSError:
        print(f"| decode={decode} | - | - |")
        continue
    last = next((r for r in reversed(rows) if "train/samples_per_s" in r), {})
    rate, wait = last.get("train/samples_per_s"), last.get("train/data_wait_share")
    print(f"| decode={decode} | {'-' if rate is None else format(rate, ',.0f')} | "
          f"{'-' if wait is None else format(wait, '.0%')} |")
EOF
} >> "$REPORT"

echo >> "$REPORT"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "Failed: ${failed[*]}." >> "$REPORT"
    echo "gpu_check: FAILED: ${failed[*]} (report: $REPORT)" >&2
    exit 1
fi
echo "Every check passed." >> "$REPORT"
echo "gpu_check: every check passed (report: $REPORT)"
