"""Two runs of a benchmark side by side, e.g. the same benchmark on two checkouts (before and after a
change): each method's time and its ratio to the unbounded DELETE measured in the same run, so that a
change of the machine's load between the runs cancels out.

    python benchmarks/compare_results.py BEFORE.json AFTER.json [--labels before after]

Reads the JSON of ``purge_benchmark.py`` (a list of results) or of ``dag_benchmark.py`` (results per
table size); prints, per method, seconds and x(a) in each run and the ratio of the two x(a).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

REFERENCE = "a. unbounded DELETE"


def methods(data: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{size label: {method: seconds}}`` of one benchmark's JSON."""
    results = data["results"]
    if isinstance(results, list):  # purge_benchmark.py: one table size
        return {f"{data['rows']:,} rows": {r["method"]: float(r["seconds"]) for r in results}}
    return {f"{int(size):,} rows": {m: float(r["seconds"]) for m, r in by.items()} for size, by in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--labels", nargs=2, default=["before", "after"])
    args = parser.parse_args()
    one, two = (methods(json.loads(p.read_text())) for p in (args.before, args.after))
    a, b = args.labels
    for size in one:
        print(f"\n{size}")
        print(f"{'method':<66}{a + ' s':>10}{'x(a)':>7}{b + ' s':>10}{'x(a)':>7}{b + '/' + a:>14}")
        ref1, ref2 = one[size].get(REFERENCE), two.get(size, {}).get(REFERENCE)
        for method, s1 in one[size].items():
            s2 = two.get(size, {}).get(method)
            x1 = s1 / ref1 if ref1 else float("nan")
            x2 = s2 / ref2 if s2 is not None and ref2 else float("nan")
            shown = f"{s2:10.2f}{x2:7.2f}{x2 / x1:14.2f}" if s2 is not None else f"{'-':>10}{'':>7}{'':>14}"
            print(f"{method:<66}{s1:10.2f}{x1:7.2f}{shown}")


if __name__ == "__main__":
    main()
