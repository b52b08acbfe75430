"""What a foreground's slow transactions happened beside: the purge's batches, the server's checkpoints,
the disk's writes, the WAL. Used by ``budget_benchmark.py`` to say where a p99 above its alone value
comes from.

A :class:`Sampler` thread reads, every half second, the server's WAL position, its checkpointer's and
backends' buffer writes (``pg_stat_bgwriter``) and, where ``/proc/diskstats`` is readable, the disk's
sectors written. Checkpoints (start, end, cause) come from the server's log where it is readable
(``log_checkpoints`` is on by default since PostgreSQL 15): ``RETENTION_BENCH_SERVER_LOG``, or Debian's
``/var/log/postgresql/postgresql-*-main.log``. :func:`causes` then counts the slow transactions (over a
threshold) that overlapped a batch, a checkpoint, both or neither, beside the share of the span each
covered: a cause that covers 20 % of the time and holds 80 % of the slow transactions is the tail.
"""

from __future__ import annotations

import glob
import os
import re
import threading
import time
from bisect import bisect_left
from datetime import datetime, timezone
from itertools import pairwise
from pathlib import Path
from typing import Any

import psycopg2

Interval = tuple[float, float]  # epoch seconds

_STATS = (
    "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint, buffers_checkpoint, buffers_clean,"
    " buffers_backend, (SELECT count(*) FROM pg_stat_progress_vacuum) FROM pg_stat_bgwriter"
)
# A transaction starting this soon after a batch's end is "after a batch": the batch's WAL (committed
# asynchronously) is flushed by the next commits, and its dirty pages are still in shared buffers.
AFTER_BATCH_S = 0.25
_CHECKPOINT = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) UTC \[\d+\] LOG:  checkpoint (starting|complete)(?:: (.*))?$"
)


def _disk_sectors_written() -> int | None:
    """Sectors written by every whole disk (not its partitions), or None where /proc is not readable."""
    try:
        disks = {d for d in os.listdir("/sys/block") if not d.startswith(("loop", "ram", "zram", "dm-"))}
        lines = Path("/proc/diskstats").read_text().splitlines()
    except OSError:
        return None
    return sum(int(f[9]) for f in map(str.split, lines) if len(f) > 9 and f[2] in disks)


# (time, WAL bytes, buffers_checkpoint, buffers_clean, buffers_backend, disk sectors written, vacuums running)
Sample = tuple[float, int, int, int, int, "int | None", int]


class Sampler:
    """Samples the server every ``interval`` seconds on a connection of its own until stopped."""

    def __init__(self, dsn: str, interval: float = 0.5, *, setup: Any = None) -> None:
        self.dsn, self.interval, self.setup = dsn, interval, setup
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = psycopg2.connect(self.dsn, application_name="bench-sampler")
        conn.autocommit = True
        if self.setup is not None:
            self.setup(conn)
        try:
            with conn.cursor() as cur:
                while not self._stop.is_set():
                    cur.execute(_STATS)
                    wal, ckpt, clean, backend, vacuums = cur.fetchone()
                    self.samples.append(
                        (time.time(), int(wal), ckpt, clean, backend, _disk_sectors_written(), int(vacuums))
                    )
                    self._stop.wait(self.interval)
        finally:
            conn.close()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def server_log() -> Path | None:
    path = os.environ.get("RETENTION_BENCH_SERVER_LOG")
    candidates = [path] if path else sorted(glob.glob("/var/log/postgresql/postgresql-*-main.log"))
    for candidate in candidates:
        if candidate and os.access(candidate, os.R_OK):
            return Path(candidate)
    return None


def checkpoints(since: float, until: float, log: Path | None = None) -> list[dict[str, Any]] | None:
    """The checkpoints that overlapped [since, until] (start, end, cause, what the server said), or None
    where the server's log cannot be read. A checkpoint still running at ``until`` ends there."""
    log = log or server_log()
    if log is None:
        return None
    out: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    with log.open(errors="replace") as lines:
        for line in lines:
            m = _CHECKPOINT.match(line.rstrip("\n"))
            if not m:
                continue
            at = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
            if m[2] == "starting":
                current = {"start": at, "cause": m[3] or ""}
            elif current is not None:
                current.update(end=at, detail=m[3] or "")
                if current["end"] >= since and current["start"] <= until:
                    out.append(current)
                current = None
    if current is not None and current["start"] <= until:
        out.append({**current, "end": until, "detail": "(still running)"})
    return out


class _Overlaps:
    """Intervals, merged: does [lo, hi] overlap any of them, and how much of a span do they cover?"""

    def __init__(self, intervals: list[Interval]) -> None:
        merged: list[list[float]] = []
        for lo, hi in sorted(intervals):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.starts = [m[0] for m in merged]
        self.merged = merged

    def __call__(self, lo: float, hi: float) -> bool:
        i = bisect_left(self.starts, hi)  # intervals starting before hi
        return i > 0 and self.merged[i - 1][1] >= lo

    def covered(self, since: float, until: float) -> float:
        """Seconds of [since, until] inside any of the intervals."""
        return sum(max(0.0, min(hi, until) - max(lo, since)) for lo, hi in self.merged)


def causes(
    transactions: list[tuple[float, float]],
    batches: list[Interval],
    checkpoint_list: list[dict[str, Any]] | None,
    samples: list[Sample],
    since: float,
    until: float,
    thresholds_ms: list[float],
) -> dict[str, Any]:
    """The slow transactions ((completed at, latency ms) over each of ``thresholds_ms``) against what they
    overlapped: a batch, a checkpoint, both, neither; beside all transactions of each kind.

    ``batches`` are the purge's batch spans; a transaction overlaps a batch when its own span (its
    scheduled start to its end) meets one.
    """
    span = max(until - since, 1e-9)
    in_batch = _Overlaps(batches)
    ckpts = [(c["start"], c["end"]) for c in checkpoint_list or []]
    in_ckpt = _Overlaps(ckpts)
    kinds = ("batch", "checkpoint", "both", "neither")
    all_counts = dict.fromkeys(kinds, 0)
    slow = {t: dict.fromkeys(kinds, 0) for t in thresholds_ms}
    first = min(thresholds_ms)
    per_10s: dict[int, int] = {}
    # The transactions that met no batch, by what else was going on: just after a batch, autovacuum, other.
    after_batch = _Overlaps([(hi, hi + AFTER_BATCH_S) for _, hi in batches])
    in_vacuum = _Overlaps([(a[0], b[0]) for a, b in pairwise(samples) if a[6] or b[6]])
    besides = ("after_batch", "autovacuum", "other")
    beside_all, beside_slow = dict.fromkeys(besides, 0), dict.fromkeys(besides, 0)
    for at, ms in transactions:
        lo = at - ms / 1000
        b, c = in_batch(lo, at), in_ckpt(lo, at)
        kind = "both" if b and c else "batch" if b else "checkpoint" if c else "neither"
        all_counts[kind] += 1
        if not b:
            where = "after_batch" if after_batch(lo, at) else "autovacuum" if in_vacuum(lo, at) else "other"
            beside_all[where] += 1
            beside_slow[where] += ms > first
        for t in thresholds_ms:
            if ms > t:
                slow[t][kind] += 1
        if ms > first:
            per_10s[int((at - since) // 10)] = per_10s.get(int((at - since) // 10), 0) + 1
    return {
        "transactions": len(transactions),
        "time_in_batches": round(in_batch.covered(since, until) / span, 3),
        "time_in_checkpoints": round(in_ckpt.covered(since, until) / span, 3) if checkpoint_list is not None else None,
        "all_by_overlap": all_counts,
        # Over each threshold: how many, and the share of each kind's transactions (slow / all of the kind).
        "slow": {
            f"{t:g}": {k: [n, round(n / all_counts[k], 4) if all_counts[k] else None] for k, n in counts.items()}
            for t, counts in slow.items()
        },
        f"slow_over_{first:g}_per_10s": [per_10s.get(i, 0) for i in range(int(span // 10) + 1)],
        # The transactions that met no batch, over the first threshold: [slow, all, share] by what was beside.
        f"no_batch_over_{first:g}": {
            k: [beside_slow[k], beside_all[k], round(beside_slow[k] / beside_all[k], 4) if beside_all[k] else None]
            for k in besides
        },
        "time_in_autovacuum": round(in_vacuum.covered(since, until) / span, 3),
        "checkpoints": [
            {
                "start_s": round(c["start"] - since, 1),
                "end_s": round(c["end"] - since, 1),
                "cause": c["cause"],
                "detail": c.get("detail", ""),
            }
            for c in checkpoint_list or []
        ],
        **_rates(samples, since, until),
    }


def _rates(samples: list[Sample], since: float, until: float) -> dict[str, Any]:
    """WAL MB/s, disk MB/s and the checkpointer's/backends' buffer writes over the span, per 10 s."""
    inside = [s for s in samples if since - 1 <= s[0] <= until + 1]
    if len(inside) < 2:
        return {}
    first, last = inside[0], inside[-1]
    seconds = max(last[0] - first[0], 1e-9)
    out: dict[str, Any] = {
        "wal_mb_s": round((last[1] - first[1]) / seconds / 2**20, 2),
        "buffers_checkpoint": last[2] - first[2],
        "buffers_clean": last[3] - first[3],
        "buffers_backend": last[4] - first[4],
    }
    if first[5] is not None and last[5] is not None:
        out["disk_write_mb_s"] = round((last[5] - first[5]) * 512 / seconds / 2**20, 2)
        out["disk_write_mb_s_per_10s"] = _per_10s(inside, 5, 512)
    out["wal_mb_s_per_10s"] = _per_10s(inside, 1, 1)
    return out


def _per_10s(samples: list[Sample], index: int, unit: int) -> list[float]:
    """MB/s of the counter at ``index`` (in ``unit`` bytes) over each 10 s or more between samples."""
    out: list[float] = []
    mark = samples[0]
    for s in samples[1:]:
        if s[0] - mark[0] >= 10:
            out.append(round((s[index] - mark[index]) * unit / (s[0] - mark[0]) / 2**20, 1))
            mark = s
    return out
