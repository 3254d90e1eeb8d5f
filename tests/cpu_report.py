"""Sum up an ACCEL_TEST_CPU_LOG file (see conftest.py): CPU seconds per module and the most
expensive tests. `python tests/cpu_report.py cpu.jsonl [N]`."""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main() -> None:
    with open(sys.argv[1]) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    per_module: dict[str, float] = defaultdict(float)
    for r in rows:
        per_module[r["test"].split("::")[0]] += r["cpu_s"]
    total = sum(per_module.values())
    print(f"{len(rows)} tests, {total:.0f} CPU s (~{total / 2 / 60:.1f} min on 2 busy cores)")
    for module, cpu in sorted(per_module.items(), key=lambda kv: -kv[1]):
        print(f"{cpu:8.1f}  {module}")
    warm, fresh = (sum(r.get(k, 0) for r in rows) for k in ("warm_runs", "fresh_runs"))
    because: dict[str, int] = defaultdict(int)
    for r in rows:
        for key, n in r.get("fresh_because", {}).items():
            because[key] += n
    print(f"\nCLI runs: {warm} warm, {fresh} fresh; of those that could have forked, sent fresh by")
    print(
        "  "
        + (
            ", ".join(f"{k} x{n}" for k, n in sorted(because.items(), key=lambda kv: -kv[1]))
            or "nothing"
        )
    )
    print()
    for r in sorted(rows, key=lambda r: -r["cpu_s"])[:top]:
        print(f"{r['cpu_s']:8.1f} cpu {r['wall_s']:8.1f} wall  {r['test']}")


if __name__ == "__main__":
    main()
