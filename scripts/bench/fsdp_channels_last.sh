#!/usr/bin/env bash
# Does channels_last still pay under FSDP? Under strategy=fsdp accel-train keeps the parameters
# contiguous (FSDP2 shards nothing else) and converts only the inputs, so each conv converts its
# weight per call. This runs the README's FSDP command with channels_last on and off, alternated
# ROUNDS times, and prints each run's train_samples_per_s from summary.json (the median of each
# setting is the number to report, with the CPU or GPU and the data used).
#
#   scripts/bench/fsdp_channels_last.sh                  # synthetic digits, 2 processes
#   DATA_DIR=../shared/data ROUNDS=3 NPROC=2 scripts/bench/fsdp_channels_last.sh   # real MNIST
#   scripts/bench/fsdp_channels_last.sh trainer.max_steps=2   # extra overrides go to every run
#
# Not run by the test suite (minutes of training); tests/test_strategy_transforms.py checks that
# the pair works.
set -euo pipefail
ROUNDS=${ROUNDS:-3}
NPROC=${NPROC:-2}
OUT=${OUT:-$(mktemp -d /tmp/fsdp_channels_last.XXXXXX)}
if [ -n "${DATA_DIR:-}" ]; then
    data=("paths.data_dir=$DATA_DIR")
else
    data=(dataset=synthetic dataset.num_train=8192 dataset.num_test=1024)
fi
for round in $(seq 1 "$ROUNDS"); do
    for cl in true false; do
        run="$OUT/cl_${cl}_$round"
        accel-train +experiment=mnist_amp strategy=fsdp launcher.nproc_per_node="$NPROC" \
            "${data[@]}" trainer.max_epochs=2 trainer.channels_last="$cl" logger=none \
            trainer.progress=none trainer.plot_curves=false trainer.target=null \
            hydra.run.dir="$run" "$@" > "$run.log" 2>&1
        python -c "import json,sys; s=json.load(open(sys.argv[1])); \
print(f'channels_last={sys.argv[2]:5} round {sys.argv[3]}: {s[\"train_samples_per_s\"]:.0f} samples/s')" \
            "$run/summary.json" "$cl" "$round"
    done
done
echo "runs and logs: $OUT"
