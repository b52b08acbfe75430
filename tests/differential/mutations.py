"""Mutation check of the differential suite: does its fixed CI set still catch the defects it was grown
for (issue 32) when one comes back?

Each mutant is one exact text substitution in the engine, re-introducing a defect the suite must catch.
For each, the tree (``git ls-files``: tracked and untracked, not ignored) is copied to a temporary
directory, the substitution applied there (never in the working tree: others edit it), and the suite
run there with this interpreter and ``PYTHONPATH`` pointing at the copy (checked: the venv's editable
install would otherwise import the working tree). A mutant is killed when some of its expected fixed
cases fail; a substitution that no longer applies (the engine's code moved on) is reported as stale,
never as a pass: update the mutant to re-introduce the defect in the code as it is now.

    .venv/bin/python -m tests.differential.mutations            # every mutant, fixed cases and reproducers
    .venv/bin/python -m tests.differential.mutations --all      # the whole differential suite per mutant
    .venv/bin/python -m tests.differential.mutations --baseline tenants-compared-as-printed

Exit status 0 when every mutant is killed (and, with --baseline, the unmutated copy passes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutant:
    defect: str
    path: str
    old: str
    new: str
    expect: tuple[str, ...]  # fixed cases (tests/differential/fixed.py) that must fail


MUTANTS = {
    # Defect 1: entries of tenant_retention / tenant_retention_table grouped by how they print, not as
    # the column compares them: 'acme' and 'ACME' of a citext column stay two overrides, and a row's
    # cutoff is whichever comes first (ACME, 7 days), not the longest (365 days).
    "tenants-compared-as-printed": Mutant(
        "issue 32 defect 1: tenants equal as the column compares them but printed differently",
        "airflow_retention/core/planning/tenants.py",
        "GROUP BY {tenant_value(target, 'x.t')} ORDER BY min(i)",
        "GROUP BY x.t ORDER BY min(i)",
        ("citext_two_keys", "collation_map_over_table", "numeric_scales"),
    ),
    # Defect 1, the map's precedence: the longest retention across the map and the table, instead of
    # the map's for a tenant both name.
    "map-does-not-win": Mutant(
        "issue 32 defect 1: tenant_retention must win over tenant_retention_table",
        "airflow_retention/core/planning/tenants.py",
        "rivals = [m for m in members if m.source == source]",
        "rivals = members",
        ("collation_map_over_table",),
    ),
    # Defect 1 in the statements: a row matched to its tenant's override by how it prints ('ACME' rows
    # of a citext column get the default cutoff of 30 days, not acme's 365).
    "rows-matched-as-printed": Mutant(
        "issue 32 defect 1: rows matched to the overrides as the column compares tenants",
        "airflow_retention/core/sql/predicate.py",
        "own = f\"(%(oc)s::timestamptz[])[array_position({tenant_values(target, '%(ot)s')}, {tenant})]\"",
        'own = f"(%(oc)s::timestamptz[])[array_position(%(ot)s::text[], {tenant}::text)]"',
        ("citext_two_keys", "numeric_scales"),
    ),
    # Defect 4: the first leaves in the tree's order every night, instead of the least recently covered.
    "leaves-first-in-tree-order": Mutant(
        "issue 32 defect 4: leaves past the chunk budget carried over, least recently covered first",
        "airflow_retention/core/planning/walkers/partitions.py",
        "chosen = set(sorted(range(len(leaves)), key=staleness)[: max(budget, 0)])",
        "chosen = set(range(max(budget, 0)))",
        ("nights_list_budget_one", "nights_range_hash"),
    ),
    # Defect 4 as it was: the first leaves, and the run not saying that it left the others.
    "leaves-cut-silently": Mutant(
        "issue 32 defect 4: the run records and verify reports the leaves it did not cover",
        "airflow_retention/core/planning/walkers/partitions.py",
        "leaves_deferred=tuple(str(leaf.relation.table) for leaf in deferred),",
        "leaves_deferred=(),",
        ("nights_list_budget_one", "nights_range_hash"),
    ),
}


def copy_tree(dest: Path) -> None:
    """The working tree's files as git sees them (tracked, and untracked but not ignored)."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def run_suite(tree: Path, whole: bool) -> tuple[bool, list[str], str]:
    """Run the differential suite (or its fixed cases and reproducers) in ``tree``; returns whether it
    passed, the failed tests and the tail of its output."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("RETENTION_FUZZ_SEED", None)
    env.pop("RETENTION_FUZZ_CASES", None)
    found = subprocess.run(
        [sys.executable, "-c", "import airflow_retention; print(airflow_retention.__file__)"],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not found.startswith(str(tree)):
        raise SystemExit(f"the copy imports airflow_retention from {found}, not from {tree}")
    report = tree / "mutation-junit.xml"
    args = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        f"--junitxml={report}",
        "tests/differential",
    ]
    if not whole:
        args += ["-k", "test_fixed or test_replay"]
    done = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True)
    failed = []
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(case.get("name", "?"))
    return done.returncode == 0, failed, "\n".join(done.stdout.splitlines()[-3:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"mutants to run (default: all): {', '.join(MUTANTS)}")
    parser.add_argument("--all", action="store_true", help="run the whole differential suite per mutant")
    parser.add_argument("--baseline", action="store_true", help="first run the unmutated copy: it must pass")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in MUTANTS]
    if unknown:
        parser.error(f"unknown mutant(s) {unknown}; known: {', '.join(MUTANTS)}")
    ok = True
    runs = (["baseline"] if args.baseline else []) + (args.names or list(MUTANTS))
    for name in runs:
        tree = Path(tempfile.mkdtemp(prefix=f"mutant-{name}-"))
        try:
            copy_tree(tree)
            mutant = MUTANTS.get(name)
            if mutant is not None:
                target = tree / mutant.path
                text = target.read_text()
                if text.count(mutant.old) != 1:
                    print(f"{name}: STALE: {mutant.path} holds {mutant.old!r} {text.count(mutant.old)} time(s)")
                    ok = False
                    continue
                target.write_text(text.replace(mutant.old, mutant.new))
            passed, failed, tail = run_suite(tree, args.all)
            if mutant is None:
                verdict = "passes" if passed else f"FAILS UNMUTATED: {failed}"
                ok = ok and passed
            else:
                caught = sorted(f for f in failed if any(f"[{e}]" in f for e in mutant.expect))
                verdict = f"killed by {failed}" if caught else f"SURVIVED (failed: {failed or 'none'})"
                ok = ok and bool(caught)
                print(f"{name} ({mutant.defect}): {mutant.path}: {mutant.old!r} -> {mutant.new!r}")
            print(f"  {verdict}\n  {tail.replace(chr(10), chr(10) + '  ')}")
        finally:
            if args.keep:
                print(f"  copy kept in {tree}")
            else:
                shutil.rmtree(tree, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
