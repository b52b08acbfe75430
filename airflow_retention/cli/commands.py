"""The subcommands: ``status``, ``plan``, ``verify``, ``init`` and ``init-ledger``. Each returns its exit code."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from airflow_retention.cli.config import (
    Target,
    connect,
    load_policies,
    load_policy_file,
    redact,
    select_policies,
    target_for,
)
from airflow_retention.cli.errors import EXIT_FAILING, EXIT_INCOMPLETE, EXIT_OK, CliError, first_line
from airflow_retention.cli.timefmt import iso, parse_instant, run_cutoff


def _console(args: argparse.Namespace) -> Any:
    from airflow_retention.cli.render import make_console

    return make_console()


def _one_policy(args: argparse.Namespace) -> Any:
    return select_policies(load_policies(args.policies), [args.policy])[0]


def _by_target(policies: Sequence[Any], dsn: str | None) -> dict[Target, list[Any]]:
    """Policies grouped by database and ledger schema, so that each is connected to once."""
    groups: dict[Target, list[Any]] = {}
    for policy in policies:
        groups.setdefault(target_for(policy, dsn), []).append(policy)
    return groups


# -- status ---------------------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    """Exit 0 when every selected policy is healthy, 3 when one is failing (an invalid entry in the file,
    a database that cannot be reached, a target check that fails, a latest run stopped on an error)."""
    from airflow_retention.cli.report import PolicyStatus, policy_status

    policies, invalid = load_policy_file(args.policies)
    if args.policy:
        # An invalid policy named on the command line is reported as invalid, not as unknown.
        invalid = [e for e in invalid if e.policy in args.policy]
        valid = [n for n in args.policy if n not in {e.policy for e in invalid}]
        policies = select_policies(policies, valid) if valid else []
    elif not policies and not invalid:
        raise CliError("the policies file holds no policy")
    if args.limit < 1:
        raise CliError("--limit must be at least 1")
    if args.watch or args.follow:
        return _watch(args, policies)
    as_of = parse_instant(args.as_of, "--as-of") if args.as_of else None
    statuses: dict[str, PolicyStatus] = {}
    unreachable: dict[str, str] = {}
    groups: dict[Target, list[Any]] = {}
    for policy in policies:
        try:
            groups.setdefault(target_for(policy, args.dsn), []).append(policy)
        except CliError as exc:  # an undefined connection: this policy's problem, the others still report
            unreachable[policy.name] = str(exc)
    for target, group in groups.items():
        try:
            with connect(target.dsn) as conn:
                for policy in group:
                    try:
                        statuses[policy.name] = policy_status(
                            conn, policy, limit=args.limit, as_of=as_of, privileges=args.dsn is None
                        )
                    except Exception as exc:  # noqa: BLE001 - e.g. no privilege on its ledger: the others still report
                        conn.rollback()
                        unreachable[policy.name] = (
                            f"cannot read its ledger in schema {policy.ledger_schema!r}: {first_line(exc)}"
                        )
        except CliError as exc:
            for policy in group:
                unreachable.setdefault(policy.name, str(exc))
    ordered = [statuses[p.name] for p in policies if p.name in statuses]
    failing = bool(invalid or unreachable or any(s.failures for s in ordered))
    if args.json:
        from airflow_retention.cli.render import emit_json

        emit_json(
            {
                "policies": [s.to_json() for s in ordered],
                "unreachable": [{"policy": name, "error": error} for name, error in unreachable.items()],
                "invalid_policies": [{"policy": e.policy, "field": e.field, "error": str(e)} for e in invalid],
                "failing": failing,
            }
        )
    else:
        from airflow_retention.cli.render import print_status

        print_status(_console(args), ordered, unreachable=unreachable, invalid=[str(e) for e in invalid])
    return EXIT_FAILING if failing else EXIT_OK


def _watch(args: argparse.Namespace, policies: list[Any]) -> int:
    from airflow_retention.cli.runs import running_run_keys
    from airflow_retention.cli.watch import follow
    from airflow_retention.core.ledger.ledger import Ledger

    if args.interval <= 0:
        raise CliError("--interval must be positive")
    if args.follow:
        name = args.follow.split("@", 1)[0]
        policies = select_policies(policies, [name])
    console = None if args.json else _console(args)
    followed = 0
    for target, group in _by_target(policies, args.dsn).items():
        ledger = Ledger(target.schema)
        with connect(target.dsn) as conn:
            if ledger.version(conn) is None:
                if args.follow:
                    raise CliError(f"no ledger in schema {target.schema!r}: run {args.follow} was never planned")
                continue
            if args.follow:
                if ledger.get_run(conn, args.follow) is None:
                    raise CliError(f"run {args.follow} is not in the ledger ({target.label})")
                keys = [args.follow]
            else:
                keys = [k for p in group for k in running_run_keys(conn, ledger, p.name)]
            if keys:
                followed += len(keys)
                follow(conn, ledger, keys, console=console, interval=args.interval, iterations=args.iterations)
    if not followed:
        if args.json:
            from airflow_retention.cli.render import emit_json_line

            emit_json_line({"time": iso(datetime.now(timezone.utc)), "runs": []})
        else:
            _console(args).print("no running purge: every planned run of these policies has all its chunks complete")
    return EXIT_OK


# -- plan -----------------------------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    from airflow_retention.core.ledger.ledger import Ledger
    from airflow_retention.core.planning.planner import compute_plan

    policy = _one_policy(args)
    cutoff = run_cutoff(policy, args.date, args.cutoff)
    if args.max_chunks < 1:
        raise CliError("--max-chunks must be at least 1")
    target = target_for(policy, args.dsn)
    with connect(target.dsn) as conn:
        # The run's date itself, not one rebuilt from the cutoff: per-tenant cutoffs are frozen from it.
        run_date = parse_instant(args.date, "--date") if args.date else None
        preview = compute_plan(conn, policy, cutoff, max_chunks=args.max_chunks, run_date=run_date)
        ledger = Ledger(policy.ledger_schema)
        stored = ledger.get_run(conn, preview.run_key) if ledger.version(conn) is not None else None
    if args.json:
        from airflow_retention.cli.render import emit_json

        emit_json(plan_json(policy, preview, stored, args.date))
    else:
        from rich.markup import escape

        from airflow_retention.cli.render import print_plan

        console = _console(args)
        print_plan(console, preview, policy, stored, args.chunks)
        if preview.sizing is not None:
            console.print(f"  chunk count: {escape(preview.sizing.reason)}", soft_wrap=True)
    return EXIT_OK


def plan_json(policy: Any, preview: Any, stored: dict[str, Any] | None, date: str | None) -> dict[str, Any]:
    return {
        "policy": policy.name,
        "table": str(policy.table),
        "date": iso(parse_instant(date, "--date")) if date else None,
        "cutoff": iso(preview.cutoff),
        "run_key": preview.run_key,
        "chunk_rows": preview.chunk_rows,
        "rows_planned": preview.rows_planned,
        "rows_estimated": preview.rows_estimated,  # true: a sample's estimate (shown "~N"), false: a count
        "chunks_count": len(preview.chunks),
        "sizing": preview.sizing.to_dict() if preview.sizing is not None else None,
        "tenant_groups": preview.tenant_groups,
        "null_timestamps": preview.null_timestamps,
        "leaves_deferred": list(preview.leaves_deferred) if preview.leaves_deferred is not None else None,
        "tenant_cutoffs": [
            {"tenant": t, "retention": r, "cutoff": iso(c), "source": s}
            for t, r, c, s in (preview.tenant_cutoffs.overrides if preview.tenant_cutoffs is not None else ())
        ],
        "stored_run": None
        if stored is None
        else {
            "state": stored["state"],
            "planned_at": iso(stored["planned_at"]),
            "chunks_expected": stored["chunks_expected"],
            "rows_planned": stored["rows_planned"],
        },
        "chunks": [
            {
                "seq": c.seq,
                "chunk_key": c.key,
                "tenants": list(c.tenants) if c.tenants is not None else None,
                "lo": c.lo,
                "hi": c.hi,
                "rows_planned": c.rows_planned,
                "partition": c.partition,
                "action": c.action,
            }
            for c in preview.chunks
        ],
        "partitions": [
            {
                "partition": str(d.relation.table),
                "action": d.action,
                "rows": d.rows,
                "chunks": d.chunks,
                "reason": d.reason,
            }
            for d in preview.partitions
        ],
    }


# -- verify ---------------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from airflow_retention.core.ledger.ledger import Ledger
    from airflow_retention.core.planning.cutoff import run_key
    from airflow_retention.core.running.verify import measure_leftovers, verify_run

    policy = _one_policy(args)
    target = target_for(policy, args.dsn)
    ledger = Ledger(policy.ledger_schema)
    with connect(target.dsn) as conn:
        has_ledger = ledger.version(conn) is not None
        if args.date is None and args.cutoff is None:
            cutoff = _latest_cutoff(conn, ledger, policy) if has_ledger else None
            if cutoff is None:
                raise CliError(f"policy {policy.name!r} has no run in the ledger yet; give --date or --cutoff")
        else:
            cutoff = run_cutoff(policy, args.date, args.cutoff)
        key = run_key(policy, cutoff)
        if has_ledger:
            verification = verify_run(conn, ledger, key)
            run = ledger.get_run(conn, key)
            chunks = ledger.chunk_rows(conn, key) if run is not None else []
            per_tenant = ledger.tenant_counts(conn, key) if run is not None else []
            tenant_cutoffs = ledger.tenant_cutoffs(conn, key) if run is not None else []
        else:
            verification, run, chunks = _no_ledger_verification(key), None, []
            per_tenant, tenant_cutoffs = [], []
        leftovers = (
            measure_leftovers(conn, policy, cutoff, ledger=ledger if run else None, run_key=key, record=False)
            if args.leftovers
            else None
        )
    if args.json:
        from airflow_retention.cli.render import emit_json

        data = verify_json(policy, cutoff, verification, run, chunks, leftovers)
        data["tenants"] = per_tenant
        data["tenant_cutoffs"] = [
            {"tenant": t, "retention": r, "cutoff": iso(c), "source": s} for t, r, c, s in tenant_cutoffs
        ]
        emit_json(data)
    else:
        from airflow_retention.cli.render import print_tenants, print_verification

        described = leftovers.describe(cutoff) if leftovers is not None else None
        print_verification(_console(args), verification, chunks, described, args.chunks)
        print_tenants(_console(args), per_tenant, tenant_cutoffs, args.chunks)
    return EXIT_OK if verification.ok else EXIT_INCOMPLETE


def _no_ledger_verification(key: str) -> Any:
    from airflow_retention.core.running.verify import Verification

    return Verification(key, 0, 0, [], run_found=False)


def _latest_cutoff(conn: Any, ledger: Any, policy: Any) -> datetime | None:
    """The cutoff of the policy's latest planned run (of its mode; lone runs left out)."""
    from airflow_retention.cli.runs import run_kind

    wanted = "dry-run" if policy.dry_run else "planned"
    runs = [r for r in ledger.recent_runs(conn, policy.name, limit=20) if run_kind(r["run_key"]) == wanted]
    return max((r["cutoff"] for r in runs), default=None)


def verify_json(
    policy: Any,
    cutoff: datetime,
    verification: Any,
    run: dict[str, Any] | None,
    chunks: list[dict[str, Any]],
    leftovers: Any,
) -> dict[str, Any]:
    return {
        "policy": policy.name,
        "run_key": verification.run_key,
        "cutoff": iso(cutoff),
        "ok": verification.ok,
        "run_found": verification.run_found,
        "state": run["state"] if run else None,
        "chunks_expected": verification.expected,
        "chunks_complete": verification.complete,
        "missing": list(verification.missing),
        "dead_letters": list(verification.left),
        # A partitioned table's leaves with eligible rows the plan left past the chunk budget: "ok" (every
        # planned chunk complete) with these is a run done that did not cover the whole table.
        "leaves_deferred": list(verification.deferred),
        "rows_deleted": verification.rows_deleted,
        "description": verification.describe(),
        "incomplete_chunks": [
            {
                "chunk_key": c["chunk_key"],
                "state": c["state"],
                "lo": c["lo"],
                "hi": c["hi"],
                "next_key": c["next_key"],
                "tenant_pos": c["tenant_pos"],
                "rows_deleted": c["rows_deleted"],
                "rows_planned": c["rows_planned"],
                "attempts": c["attempts"],
                "last_batch_at": iso(c["last_batch_at"]),
                "last_error": c["last_error"],
            }
            for c in chunks
            if c["state"] != "complete"
        ],
        "leftovers": None
        if leftovers is None
        else {
            "count": leftovers.count,
            "capped": leftovers.capped,
            "oldest": iso(leftovers.oldest),
            "lag_seconds": leftovers.lag_seconds,
        },
    }


# -- init -----------------------------------------------------------------------------------------


def cmd_init(args: argparse.Namespace) -> int:
    from pathlib import Path

    from airflow_retention.core.policy.loading import load_policies as load_policy_file
    from airflow_retention.scaffold import POLICIES_FILE, next_steps, write_scaffold

    folder = Path(args.dags_folder).expanduser().absolute()
    if getattr(args, "airflow_metadata", False):
        return _init_metadata(args, folder)
    try:
        written = write_scaffold(folder, force=args.force)
    except (FileExistsError, NotADirectoryError) as exc:
        raise CliError(f"init: {exc}") from None
    policies = load_policy_file(folder / POLICIES_FILE)
    steps = next_steps(folder, policies, datetime.now(timezone.utc).date().isoformat())
    return _report_init(
        args,
        {"written": [str(p) for p in written], "policies": [p.name for p in policies], "next_steps": steps},
        [
            f"wrote {written[0]} (one DAG per policy of the YAML file beside it)",
            f"wrote {written[1]} ({len(policies)} example policies: {', '.join(p.name for p in policies)})",
        ],
        steps,
    )


def _report_init(args: argparse.Namespace, doc: dict[str, Any], lines: list[str], steps: list[str]) -> int:
    """What ``init`` wrote and the next steps, as JSON or as text."""
    if args.json:
        from airflow_retention.cli.render import emit_json

        emit_json(doc)
        return EXIT_OK
    print("\n".join(lines))
    print("\nNext steps:")
    for n, step in enumerate(steps, 1):
        print(f"  {n}. " + step.replace("\n", "\n     "))
    return EXIT_OK


def _init_metadata(args: argparse.Namespace, folder: Path) -> int:
    from airflow_retention.metadata import load_settings, metadata_policies
    from airflow_retention.scaffold import METADATA_FILES, METADATA_SETTINGS_FILE, metadata_next_steps, write_scaffold

    try:
        written = write_scaffold(folder, force=args.force, names=METADATA_FILES)
    except (FileExistsError, NotADirectoryError) as exc:
        raise CliError(f"init: {exc}") from None
    settings = load_settings(folder / METADATA_SETTINGS_FILE)
    # dict.fromkeys: a table with per-DAG retention has two policies (its rows without a DAG id).
    tables = list(dict.fromkeys(p.table.name for p in metadata_policies(settings)))
    steps = metadata_next_steps(folder, settings)
    return _report_init(
        args,
        {"written": [str(p) for p in written], "tables": tables, "next_steps": steps},
        [
            f"wrote {written[0]} (the DAG retention_airflow_metadata)",
            f"wrote {written[1]} (retention {settings.retention}; tables in airflow db clean's order:",
            f"    {', '.join(tables)})",
        ],
        steps,
    )


# -- init-ledger ----------------------------------------------------------------------------------


def cmd_init_ledger(args: argparse.Namespace) -> int:
    from airflow_retention.core.ledger.ledger import Ledger
    from airflow_retention.core.policy.identifiers import check_ident

    results = []
    for target in _ledger_targets(args):
        try:
            check_ident(target.schema)
        except ValueError as exc:
            raise CliError(f"--schema {target.schema!r}: {exc}") from None
        ledger = Ledger(target.schema)
        with connect(target.dsn) as conn:
            before = ledger.version(conn)
            after = ledger.ensure(conn)
        action = "created" if before is None else ("up to date" if before == after else f"migrated from v{before}")
        results.append(
            {
                "database": redact(target.dsn),
                "schema": target.schema,
                "version_before": before,
                "version": after,
                "action": action,
            }
        )
    if args.json:
        from airflow_retention.cli.render import emit_json

        emit_json({"ledgers": results})
    else:
        console = _console(args)
        for r in results:
            console.print(f"ledger schema {r['schema']} in {r['database']}: version {r['version']} ({r['action']})")
    return EXIT_OK


def _ledger_targets(args: argparse.Namespace) -> list[Target]:
    """``--dsn`` with ``--schema``: that ledger. Otherwise the ledgers of the policies (all, or those
    named), on ``--dsn`` when given; ``--dsn`` alone without a policies file: schema ``retention``."""
    from airflow_retention.cli.config import policies_path

    if args.schema:
        if not args.dsn:
            raise CliError("--schema needs --dsn (or name policies instead, to use their connections)")
        return [Target(args.dsn, args.schema)]
    if args.dsn and not args.policy and policies_path(args.policies) is None:
        return [Target(args.dsn, "retention")]
    policies = select_policies(load_policies(args.policies), args.policy)
    return list(_by_target(policies, args.dsn))
