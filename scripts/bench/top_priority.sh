#!/usr/bin/env bash
# Run a benchmark with top CPU priority on a shared machine: the command goes into a cgroup
# (v1 cpu controller) with the largest cpu.shares, so background work (other test suites,
# ideally at `nice 19`) only gets the CPU this command leaves idle. Needs root. What it cannot
# isolate is the memory bandwidth and caches the neighbours still use: say so with the numbers.
#   sudo scripts/bench/top_priority.sh python scripts/bench/mnist_race.py --rounds 3
set -euo pipefail
group=/sys/fs/cgroup/cpu/accel_bench
if [ ! -d /sys/fs/cgroup/cpu ]; then
    echo "top_priority.sh: no cgroup v1 cpu controller at /sys/fs/cgroup/cpu; running as is" >&2
    exec "$@"
fi
mkdir -p "$group"
echo 262144 > "$group/cpu.shares"  # the maximum; a plain process in the root group weighs 1024
echo $$ > "$group/tasks"            # this shell, then the command it becomes, and its children
exec "$@"
