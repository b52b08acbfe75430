"""The key walkers: chunks of key ranges, per tenant or across tenants, planned from the eligible rows'
key groups (one per tenant) cut at boundaries the server finds walking the index, and batches of the
next ``n`` keys of the range (of one tenant at a time when the chunk lists tenants).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from airflow_retention.core.db import dbapi
from airflow_retention.core.ledger.records import ChunkSpec
from airflow_retention.core.planning.cutoff import run_key
from airflow_retention.core.planning.plans import Preview, empty_preview
from airflow_retention.core.planning.probes import nothing_eligible, warn_interleaved_tenants, warn_null_timestamps
from airflow_retention.core.planning.sizing import measured_rate, size_chunks
from airflow_retention.core.planning.tenants import TenantCutoffs
from airflow_retention.core.planning.walkers.base import Batch, Position, Walker
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.core.sql.predicate import MAX_KEY, MIN_KEY
from airflow_retention.core.sql.reads import (
    boundary_statement,
    group_statement,
)
from airflow_retention.core.sql.target import TargetInfo

log = logging.getLogger(__name__)


# A shared chunk lists its tenants in XCom and in the ledger: keep that list bounded.
MAX_TENANTS_PER_CHUNK = 500
_GROWTH = 1.25


@dataclass(frozen=True)
class Group:
    """Eligible rows of one tenant (or of the whole table): count and key bounds."""

    tenant: str | None
    rows: int
    lo: int
    hi: int  # exclusive


def chunk_key(tenants: tuple[str, ...] | None, lo: int, hi: int) -> str:
    """Deterministic, readable chunk identity within a run."""
    if tenants is None:
        part = "all"
    elif len(tenants) == 1:
        part = f"t={tenants[0]}"
    else:
        part = f"t={tenants[0]}..{tenants[-1]}({len(tenants)})"
    return f"{part}:{lo}-{hi}"


def chunk_count(groups: Iterable[Group], chunk_rows: int) -> int:
    """How many chunks :func:`split` makes of these groups, without touching the database."""
    count = 0
    pack_rows = pack_size = 0
    for g in groups:
        if g.rows > chunk_rows:
            count += math.ceil(g.rows / chunk_rows)
            continue
        if pack_size and (pack_rows + g.rows > chunk_rows or pack_size >= MAX_TENANTS_PER_CHUNK):
            count += 1
            pack_rows = pack_size = 0
        pack_rows += g.rows
        pack_size += 1
    return count + (1 if pack_size else 0)


def choose_chunk_rows(groups: list[Group], chunk_rows: int, max_chunks: int) -> int:
    """The smallest chunk size from ``chunk_rows`` up whose plan fits in ``max_chunks`` mapped tasks."""
    total = sum(g.rows for g in groups)
    size = max(chunk_rows, math.ceil(total / max_chunks) if total else chunk_rows)
    while chunk_count(groups, size) > max_chunks:
        size = math.ceil(size * _GROWTH)
    return size


def read_groups(conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoffs: TenantCutoffs) -> list[Group]:
    rows = dbapi.fetch_all(
        conn,
        group_statement(policy, target),
        {**cutoffs.params(), "lo": MIN_KEY, "hi": MAX_KEY},
        lock_timeout_ms=policy.lock_timeout_ms,
    )
    groups = []
    for tenant, count, lo, hi in rows:
        if not count:
            continue
        if policy.tenant_column is not None and tenant is None:
            log.warning(
                "policy %s: %d eligible row(s) have a NULL %s and are not planned: a NULL tenant belongs to no"
                " chunk; give those rows a tenant or use a policy without tenant_column",
                policy.name,
                count,
                policy.tenant_column,
            )
            continue
        groups.append(Group(tenant=tenant, rows=int(count), lo=int(lo), hi=int(hi) + 1))
    return groups


def _merge(groups: list[Group]) -> Group:
    """All tenants as one group: chunks then cover key ranges of every tenant (``tenants`` None)."""
    return Group(
        tenant=None,
        rows=sum(g.rows for g in groups),
        lo=min(g.lo for g in groups),
        hi=max(g.hi for g in groups),
    )


def split(
    conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoffs: TenantCutoffs, groups: list[Group], chunk_rows: int
) -> list[ChunkSpec]:
    """Cut the groups into chunks of at most ``chunk_rows`` eligible rows, in a deterministic order."""
    chunks: list[ChunkSpec] = []
    pack: list[Group] = []

    def flush() -> None:
        if pack:
            tenants = tuple(g.tenant for g in pack if g.tenant is not None) or None
            lo, hi = min(g.lo for g in pack), max(g.hi for g in pack)
            chunks.append(_spec(tenants, lo, hi, sum(g.rows for g in pack), len(chunks)))
            pack.clear()

    for group in groups:
        if group.rows > chunk_rows:
            flush()
            chunks.extend(_walk(conn, policy, target, cutoffs, group, chunk_rows, first_seq=len(chunks)))
            continue
        if pack and (sum(g.rows for g in pack) + group.rows > chunk_rows or len(pack) >= MAX_TENANTS_PER_CHUNK):
            flush()
        pack.append(group)
    flush()
    return chunks


def _walk(
    conn: Any,
    policy: RetentionPolicy,
    target: TargetInfo,
    cutoffs: TenantCutoffs,
    group: Group,
    chunk_rows: int,
    first_seq: int,
) -> list[ChunkSpec]:
    tenants = (group.tenant,) if group.tenant is not None else None
    statement = boundary_statement(policy, target, tenant_filter=tenants is not None)
    params = {**cutoffs.params(), "hi": group.hi, "offset": chunk_rows, "tenant": group.tenant}
    chunks: list[ChunkSpec] = []
    lo = group.lo
    remaining = group.rows
    while True:
        rows = dbapi.fetch_all(conn, statement, {**params, "lo": lo}, lock_timeout_ms=policy.lock_timeout_ms)
        if not rows:
            chunks.append(_spec(tenants, lo, group.hi, max(remaining, 0), first_seq + len(chunks)))
            return chunks
        boundary = int(rows[0][0])
        chunks.append(_spec(tenants, lo, boundary, chunk_rows, first_seq + len(chunks)))
        remaining -= chunk_rows
        lo = boundary


def _spec(tenants: tuple[str, ...] | None, lo: int, hi: int, rows: int, seq: int) -> ChunkSpec:
    return ChunkSpec(key=chunk_key(tenants, lo, hi), lo=lo, hi=hi, tenants=tenants, seq=seq, rows_planned=rows)


def plan_keys(
    conn: Any, policy: RetentionPolicy, target: TargetInfo, cutoffs: TenantCutoffs, max_chunks: int
) -> Preview:
    """Key chunks: the eligible rows' key groups (one per tenant), packed or cut into chunks of at most
    ``chunk_rows`` rows each, so that a tenant with 50 times the rows gets 50 times the chunks while
    small tenants share one. Boundaries are found by the server walking the index (``OFFSET n LIMIT
    1``): the planner holds one row per tenant, never the eligible keys."""
    cutoff = cutoffs.cutoff
    empty = nothing_eligible(conn, policy, target, cutoffs, null_tenants=True)
    if empty is not None:
        return empty_preview(conn, policy, cutoffs, empty, None, max_chunks)
    groups = read_groups(conn, policy, target, cutoffs)
    null_timestamps = warn_null_timestamps(conn, policy)
    if len(groups) > 1:
        warn_interleaved_tenants(conn, policy)
    if math.ceil(len(groups) / MAX_TENANTS_PER_CHUNK) > max_chunks:
        log.warning(
            "policy %s: %d tenants have eligible rows, more than %d chunks of at most %d tenants can list;"
            " planning by key range across tenants instead (deletion is the same, per-tenant fairness is lost)",
            policy.name,
            len(groups),
            max_chunks,
            MAX_TENANTS_PER_CHUNK,
        )
        groups = [_merge(groups)]
    sizing = size_chunks(
        policy, sum(g.rows for g in groups), None, measured_rate(conn, policy, blocks=False), max_chunks
    )
    size = choose_chunk_rows(groups, sizing.chunk_rows, max_chunks)
    if size != sizing.chunk_rows:
        log.warning(
            "policy %s: %d eligible rows at chunk_rows=%d would need more than %d chunks (Airflow's [core]"
            " max_map_length); chunks grow to %d rows each",
            policy.name,
            sum(g.rows for g in groups),
            sizing.chunk_rows,
            max_chunks,
            size,
        )
    chunks = split(conn, policy, target, cutoffs, groups, size)
    return Preview(
        run_key=run_key(policy, cutoff),
        cutoff=cutoff,
        chunks=chunks,
        rows_planned=sum(g.rows for g in groups),
        chunk_rows=size,
        tenant_groups=len(groups),
        null_timestamps=null_timestamps,
        sizing=sizing,
    )


class KeyWalker(Walker):
    """Batches of the next ``size`` keys of a key range, eligible or not, found by walking the key index
    (an index-only scan); the statement deletes the eligible rows among them."""

    unit = "ids"

    def __init__(self, chunk: ChunkSpec, walk: str, tenants: Sequence[str] | None = None) -> None:
        super().__init__(chunk, tenants)
        self.walk = walk  # batch_walk_statement, of one tenant when the walker has tenants

    def next_batch(self, cur: Any, at: Position, size: int) -> Batch:
        tenant = self.tenants[at.tenant] if self.tenants is not None else None
        params = {"lo": at.key, "hi": self.chunk.hi, "limit": size, "tenant": tenant}
        cur.execute(self.walk, params)
        extent = cur.fetchone()
        # No row: fewer than ``size`` keys were left, and the batch runs to the end of the range.
        last = int(extent[0]) if extent is not None else self.chunk.hi - 1
        full = extent is not None and last + 1 < self.chunk.hi
        return Batch(lo=at.key, hi=last + 1, full=full, params={**params, "upper": last}, tenant=tenant)


class TenantKeyWalker(KeyWalker):
    """The key range of each of a chunk's tenants in turn, along the (tenant, key) index: a chunk that
    packs small tenants, or a tenant's share of a large one."""

    def __init__(self, chunk: ChunkSpec, walk: str, tenants: Sequence[str]) -> None:
        super().__init__(chunk, walk, tenants)
