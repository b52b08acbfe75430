"""Drawing with ``rich``: the status tables, the plan, the verification and the progress of a purge."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from airflow_retention.cli.report import PolicyStatus, budget_line, covered_line, paused_line
from airflow_retention.cli.runs import RunSummary
from airflow_retention.cli.timefmt import human_seconds, short
from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.ledger.slo import BUDGET_VERSION

# Piped output (files, CI logs, tests) gets wide tables instead of rich's 80 columns.
PIPE_WIDTH = 160


def make_console(stream: TextIO | None = None) -> Console:
    """A console on ``stream`` (stdout, looked up at call time so that tests can capture it)."""
    stream = stream or sys.stdout
    is_tty = hasattr(stream, "isatty") and stream.isatty()
    width = None if is_tty or os.environ.get("COLUMNS") else PIPE_WIDTH
    return Console(file=stream, width=width, highlight=False, soft_wrap=False)


def emit_json(data: Any, stream: TextIO | None = None) -> None:
    """One JSON document (indented), or one line with ``compact`` for streams of events."""
    stream = stream or sys.stdout
    stream.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    stream.flush()


def emit_json_line(data: Any, stream: TextIO | None = None) -> None:
    stream = stream or sys.stdout
    stream.write(json.dumps(data, ensure_ascii=False) + "\n")
    stream.flush()


def rows_text(run: RunSummary) -> str:
    if run.kind == "dry-run":
        return f"{run.rows_matched:,} matched"
    text = f"{run.rows_deleted:,}"
    return f"{text} ({run.rows_archived:,} archived)" if run.rows_archived else text


def lag_text(run: RunSummary) -> str:
    if run.cleanup_lag_seconds is None:
        # A large run leaves the walk to the next run's planning (core/running/verify.py, lag_left_to_next_run).
        return "at next run" if run.state == "complete" and run.kind in ("planned", "dry-run") else "—"
    text = human_seconds(run.cleanup_lag_seconds)
    return f"{text}, {run.eligible_left:,} left" if run.eligible_left else text


def state_text(run: RunSummary) -> str:
    colour = "green" if run.state == "complete" else ("yellow" if run.running else "cyan")
    if run.state == "complete" and run.leaves_deferred:
        colour = "yellow"  # done, but its plan left leaves of the table past the chunk budget
    label = run.status if run.kind in ("planned", "lone") else f"{run.status} (dry run)"
    return f"[{colour}]{escape(label)}[/]"


def status_table(status: PolicyStatus) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for name, justify in (
        ("cutoff", "left"),
        ("state", "left"),
        ("chunks", "right"),
        ("rows deleted", "right"),
        ("rows planned", "right"),
        ("duration", "right"),
        ("cleanup lag", "right"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)
    for run in status.runs:
        table.add_row(
            short(run.cutoff),
            state_text(run),
            f"{run.chunks_complete}/{run.chunks_expected}",
            rows_text(run),
            f"{run.rows_planned:,}",
            run.duration_text(),
            lag_text(run),
        )
    return table


def print_status(
    console: Console,
    statuses: Sequence[PolicyStatus],
    *,
    unreachable: Mapping[str, str] | None = None,
    invalid: Sequence[str] = (),
) -> None:
    """Each policy's runs and warnings; a failing policy's failures first, in red; then the policies whose
    database cannot be reached and the invalid entries of the file."""
    for index, status in enumerate(statuses):
        if index:
            console.print()
        p = status.policy
        version = f"ledger {p.ledger_schema} v{status.ledger_version}" if status.ledger_version else "no ledger"
        console.print(
            f"[bold]{escape(p.name)}[/]  {escape(str(p.table))} · retention {escape(str(p.retention))}"
            f" · {escape(str(p.schedule))}{' · dry run' if p.dry_run else ''} · {escape(version)}"
        )
        if status.runs:
            console.print(status_table(status))
        elif status.ledger_version:
            console.print("  no run in the ledger yet")
        # Beside the runs, what held them: the budget, the latest run's pauses by reason (a ledger older than
        # version 8 has neither), and the cleanup SLO.
        if (status.ledger_version or 0) >= BUDGET_VERSION:
            console.print(f"  {escape(budget_line(status.budget, enabled=p.budget.enabled))}", soft_wrap=True)
            paused = paused_line(status.paused_run_key, status.paused)
            if paused is not None:
                console.print(f"  {escape(paused)}", soft_wrap=True)
        if status.slo is not None:
            console.print(f"  {escape(status.slo.describe())}", soft_wrap=True)
        failures = status.failures
        for failure in failures:
            console.print(f"  [red]failing:[/] {escape(failure.message)}", soft_wrap=True)
        for warning in status.warnings:
            if warning not in failures:
                console.print(f"  [yellow]warning:[/] {escape(warning.message)}", soft_wrap=True)
        covered = covered_line(status.covered)
        if covered is not None:
            console.print(f"  {escape(covered)}", soft_wrap=True)
        if not status.warnings:
            console.print("  [green]no warnings[/]")
    for name, error in (unreachable or {}).items():
        console.print()
        console.print(f"[bold]{escape(name)}[/]  [red]failing:[/] {escape(error)}", soft_wrap=True)
    for error in invalid:
        console.print()
        console.print(
            f"[red]invalid policy:[/] {escape(error)} (its DAG fails at once until it is fixed)", soft_wrap=True
        )


def rows_count(rows: int, estimated: bool) -> str:
    """A row count as the plan shows it: ``~44,390`` for a sample's estimate, ``42,167`` for a count."""
    return f"~{rows:,}" if estimated else f"{rows:,}"


def print_plan(console: Console, preview: Any, policy: Any, stored: dict[str, Any] | None, max_rows: int) -> None:
    console.print(f"[bold]plan of run {escape(preview.run_key)}[/] (dry run of the planner: nothing written)")
    console.print(
        f"  table {escape(str(policy.table))}, cutoff {short(preview.cutoff)} (rows with"
        f" {escape(policy.timestamp_column)} before it{' and the condition' if policy.condition else ''})"
    )
    explicit = policy.chunk_rows  # None: chunks sized by time (the "chunk count" line says how)
    grown = f" (grown from {explicit:,} to fit max chunks)" if explicit and preview.chunk_rows != explicit else ""
    estimated = preview.rows_estimated
    rows = f"{rows_count(preview.rows_planned, estimated)} eligible row(s){' (estimated)' if estimated else ''}"
    # Tenant groups exist only for key chunks of a policy with tenants (block chunks take all tenants at once).
    groups = f", {preview.tenant_groups} tenant group(s)" if policy.tenant_column and preview.tenant_groups else ""
    console.print(f"  {len(preview.chunks)} chunk(s), {rows}{groups}, chunk_rows {preview.chunk_rows:,}{grown}")
    if preview.null_timestamps:
        console.print(
            f"  [yellow]warning:[/] {preview.null_timestamps:,} row(s) with a NULL timestamp are never deleted"
        )
    if stored is not None:
        console.print(
            f"  [cyan]already in the ledger[/]: planned {short(stored['planned_at'])}, state {stored['state']},"
            f" {stored['chunks_expected']} chunk(s), {stored['rows_planned']:,} row(s); a planner would reuse that"
            " stored plan"
        )
    if preview.leaves_deferred:
        from airflow_retention.core.running.verify import not_covered

        console.print(
            f"  [yellow]warning:[/] {escape(not_covered(preview.leaves_deferred, len(preview.chunks)))}",
            soft_wrap=True,
        )
    if preview.partitions:
        console.print(partitions_table(preview.partitions))
    if not preview.chunks:
        console.print("  nothing eligible: the run would be recorded complete with 0 rows")
        return
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold", show_footer=True)
    table.add_column("#", justify="right", footer="")
    table.add_column("chunk", footer="total")
    table.add_column("rows planned", justify="right", footer=rows_count(preview.rows_planned, estimated))
    table.add_column("chunk key (ledger)")
    for chunk in preview.chunks[:max_rows]:
        table.add_row(
            str(chunk.seq),
            escape(chunk.label()),
            rows_count(chunk.rows_planned or 0, estimated),
            escape(chunk.key),
        )
    console.print(table)
    if len(preview.chunks) > max_rows:
        console.print(f"  … and {len(preview.chunks) - max_rows} more chunk(s) (--chunks N, or --json for all)")


def partitions_table(decisions: Sequence[Any]) -> Table:
    """Per partition of a partitioned table: what the run does with it (drop, detach, delete rows,
    skip), the rows concerned (estimates) and why."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold", title_justify="left")
    table.title = "partitions"
    table.add_column("partition")
    table.add_column("action")
    table.add_column("rows", justify="right")
    table.add_column("chunks", justify="right")
    table.add_column("why")
    for d in decisions:
        style = {"drop": "red", "detach": "yellow", "skip": "dim"}.get(d.action, "")
        action = f"[{style}]{d.action}[/]" if style else d.action
        rows = f"{d.rows:,}" if d.action != "skip" else ""
        table.add_row(escape(str(d.relation.table)), action, rows, str(d.chunks or ""), escape(d.reason))
    return table


def print_tenants(
    console: Console, per_tenant: list[dict[str, Any]], cutoffs: Sequence[tuple[Any, ...]], max_rows: int
) -> None:
    """Rows deleted per tenant (one-pass tenant policies) and the run's frozen per-tenant cutoffs."""
    if cutoffs:
        shown = ", ".join(f"{t} before {short(c)} ({r}, {s})" for t, r, c, s in cutoffs[:max_rows])
        more = f" and {len(cutoffs) - max_rows} more" if len(cutoffs) > max_rows else ""
        console.print(f"  tenants with a retention of their own: {escape(shown)}{more}", soft_wrap=True)
    if per_tenant:
        total = sum(t["rows_deleted"] for t in per_tenant)
        top = ", ".join(f"{t['tenant']} {t['rows_deleted']:,}" for t in per_tenant[:max_rows])
        more = f" … ({len(per_tenant) - max_rows} more)" if len(per_tenant) > max_rows else ""
        console.print(
            f"  rows deleted per tenant ({len(per_tenant)} tenant(s), {total:,} in all): {escape(top)}{more}",
            soft_wrap=True,
        )


def resume_position(chunk: dict[str, Any]) -> str:
    """Where an incomplete chunk resumes: its next key (or block) and, in a key chunk that packs several
    tenants (one at a time), which tenant it is at."""
    tenants = chunk["tenants"]
    if tenants and len(tenants) > 1:
        pos = chunk["tenant_pos"] or 0
        return f"tenant {escape(str(tenants[pos]))} ({pos + 1} of {len(tenants)}) · {chunk['next_key']:,}"
    return f"{chunk['next_key']:,}"


def print_verification(
    console: Console, verification: Any, chunks: list[dict[str, Any]], leftovers: str | None, max_rows: int
) -> None:
    # A run whose planned chunks are complete but whose plan left leaves out is done, yet not all of the table.
    colour = ("yellow" if verification.deferred else "green") if verification.ok else "red"
    console.print(f"[{colour}]{escape(verification.describe())}[/]", soft_wrap=True)
    incomplete = [c for c in chunks if c["state"] != "complete"]
    if incomplete:
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
        for name in ("chunk", "state", "next key", "rows deleted", "rows planned", "attempts"):
            table.add_column(name, justify="left" if name in ("chunk", "state") else "right", no_wrap=True)
        table.add_column("last batch", no_wrap=True)
        table.add_column("chunk key (ledger)", no_wrap=True)
        table.add_column("last error")
        for c in incomplete[:max_rows]:
            table.add_row(
                escape(ChunkSpec.of_row(c).label()),
                c["state"],
                resume_position(c),
                f"{c['rows_deleted']:,}",
                f"{c['rows_planned'] or 0:,}",
                str(c["attempts"]),
                short(c["last_batch_at"]),
                escape(c["chunk_key"]),
                escape(c["last_error"] or ""),
            )
        console.print(table)
        if len(incomplete) > max_rows:
            console.print(f"  … and {len(incomplete) - max_rows} more incomplete chunk(s)")
    if leftovers is not None:
        console.print(f"  left behind: {escape(leftovers)}", soft_wrap=True)
