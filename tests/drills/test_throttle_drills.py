"""Throttle drill with a real streaming standby: replay paused on the standby makes the primary's
``pg_stat_replication.replay_lag`` grow; the purge must pause, give up as retryable naming the lag, and
complete once replay resumes.

The pair (primary + standby) is private to the test: ``initdb`` in a temporary directory, started on
free ports, the standby made with ``pg_basebackup -R -X stream``. The shared test server is not used
because its ``pg_hba.conf`` allows no replication connections, and a standby paused on it would show
its lag to every other test and engineer using that server.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg2
import pytest
from psycopg2.extensions import make_dsn

from airflow_retention.core.errors import RetryableError
from airflow_retention.core.planning.planner import plan_run
from airflow_retention.core.running.engine import run_chunk
from airflow_retention.core.running.pacing import read_pressure
from tests.conftest import connect
from tests.core.helpers import (
    CUTOFF,
    create_events,
    eligible_ids,
    fill_events,
    ledger_chunk,
    make_policy,
    rows,
    scalar,
    wait_for,
)


def _bindir() -> Path:
    """The PostgreSQL server binaries: ``pg_config --bindir``, else the newest Debian installation."""
    candidates = []
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=False).stdout.strip()
        if out:
            candidates.append(Path(out))
    debian = Path("/usr/lib/postgresql")
    if debian.is_dir():
        candidates += [p / "bin" for p in sorted(debian.iterdir(), key=lambda p: p.name, reverse=True)]
    for path in candidates:
        if (path / "initdb").exists() and (path / "pg_basebackup").exists():
            return path
    raise AssertionError(f"no PostgreSQL server binaries (initdb, pg_basebackup) in {candidates}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Pair:
    primary_dsn: str
    standby_dsn: str


def _wait_streaming(primary: Any, timeout: float = 20) -> None:
    wait_for(
        lambda: scalar(primary, "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'") == 1,
        timeout,
        "the standby to stream from the primary",
        interval=0.05,
    )


@pytest.fixture
def replica_pair() -> Iterator[Pair]:
    """A primary and a hot standby streaming from it; both stopped and removed afterwards, even on failure."""
    bindir = _bindir()
    root = Path(tempfile.mkdtemp(prefix="retention-replica-"))
    as_postgres: list[str] = []
    if os.geteuid() == 0:  # initdb and postgres refuse to run as root
        shutil.chown(root, "postgres")
        as_postgres = ["runuser", "-u", "postgres", "--"]
    primary_dir, standby_dir = root / "primary", root / "standby"
    primary_port, standby_port = _free_port(), _free_port()
    started: list[Path] = []

    def run(*args: str | Path) -> None:
        done = subprocess.run([*as_postgres, *map(str, args)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{args[0]} failed: {done.stdout}\n{done.stderr}"

    try:
        run(bindir / "initdb", "-D", primary_dir, "-U", "postgres", "-A", "trust", "-N")
        with (primary_dir / "postgresql.conf").open("a") as conf:
            conf.write(
                f"port = {primary_port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{root}'\n"
                "fsync = off\nwal_level = replica\nmax_wal_senders = 4\n"
            )
        run(bindir / "pg_ctl", "-D", primary_dir, "-l", root / "primary.log", "-w", "start")
        started.append(primary_dir)
        run(
            bindir / "pg_basebackup",
            "-h",
            "127.0.0.1",
            "-p",
            str(primary_port),
            "-U",
            "postgres",
            "-D",
            standby_dir,
            "-R",
            "-X",
            "stream",
        )
        # wal_receiver_status_interval=1: the standby reports its replay position (and the primary
        # recomputes replay_lag) every second, not every 10 s.
        options = f"-p {standby_port} -c hot_standby=on -c wal_receiver_status_interval=1"
        run(bindir / "pg_ctl", "-D", standby_dir, "-l", root / "standby.log", "-o", options, "-w", "start")
        started.append(standby_dir)
        pair = Pair(
            primary_dsn=make_dsn(host="127.0.0.1", port=primary_port, user="postgres", dbname="postgres"),
            standby_dsn=make_dsn(host="127.0.0.1", port=standby_port, user="postgres", dbname="postgres"),
        )
        primary = psycopg2.connect(pair.primary_dsn)
        primary.autocommit = True
        try:
            _wait_streaming(primary)
        finally:
            primary.close()
        yield pair
    finally:
        for data in reversed(started):
            subprocess.run(
                [*as_postgres, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                capture_output=True,
                timeout=60,
                check=False,
            )
        shutil.rmtree(root, ignore_errors=True)


def test_replica_lag_pauses_the_purge_then_it_completes_after_replay_resumes(replica_pair: Pair, driver: str) -> None:
    started = time.monotonic()
    primary = psycopg2.connect(replica_pair.primary_dsn)
    primary.autocommit = True
    standby = psycopg2.connect(replica_pair.standby_dsn)
    standby.autocommit = True
    conn = connect(driver, replica_pair.primary_dsn)
    try:
        schema = "drill"
        rows(primary, f'CREATE SCHEMA "{schema}"')
        table = create_events(primary, schema)
        fill_events(primary, table, 3_000)
        rows(primary, f'CREATE TABLE "{schema}".wal_filler (i int)')
        eligible = eligible_ids(primary, table)
        total = scalar(primary, f"SELECT count(*) FROM {table}")
        policy = make_policy(
            schema,
            batch_size=400,
            throttle={"max_replica_lag": "500ms", "backoff": "50ms", "give_up_after": "1s"},
        )
        (chunk,) = (plan := plan_run(conn, policy, CUTOFF)).chunks
        assert read_pressure(conn, policy).calm

        # Replay stuck on the standby while the primary keeps writing: replay_lag grows past 500 ms.
        rows(standby, "SELECT pg_wal_replay_pause()")
        lag = "SELECT coalesce(max(extract(epoch FROM replay_lag)), 0) FROM pg_stat_replication"

        def lagging() -> bool:
            rows(primary, f'INSERT INTO "{schema}".wal_filler VALUES (1)')
            return float(scalar(primary, lag)) > 0.8

        wait_for(lagging, 15, "replay_lag on the primary to exceed 0.8 s", interval=0.1)
        reading = read_pressure(conn, policy)
        assert len(reading.reasons) == 1 and "replica replay lag" in reading.reasons[0], reading

        pauses: list[float] = []

        def sleep(seconds: float) -> None:
            pauses.append(seconds)
            time.sleep(seconds)

        with pytest.raises(RetryableError, match="replica replay lag") as info:
            run_chunk(conn, policy, CUTOFF, chunk, sleep=sleep)
        assert "give_up_after 1 s" in str(info.value)
        # Backing off: pause i within [step/2, step] of a step doubling from 50 ms, until 1 s is spent.
        assert sum(pauses) >= 1.0 and sum(pauses[:-1]) < 1.0
        assert all(0.05 * 2**i / 2 <= p <= 0.05 * 2**i for i, p in enumerate(pauses)), pauses
        # Nothing deleted; the ledger shows the pauses and why.
        assert eligible_ids(primary, table) == eligible
        row = ledger_chunk(primary, policy.ledger_schema, plan.run_key, chunk.key)
        assert (row["state"], row["rows_deleted"], row["batches"]) == ("pending", 0, 0)
        assert row["backoffs"] == len(pauses)
        assert row["backoff_seconds"] == pytest.approx(sum(pauses))
        assert "replica replay lag" in row["last_error"]

        # Replay resumes: the lag clears, and the retry completes.
        rows(standby, "SELECT pg_wal_replay_resume()")
        wait_for(lambda: read_pressure(conn, policy).calm, 15, "the replica lag to clear", interval=0.1)
        first_pauses = len(pauses)
        pauses.clear()
        result = run_chunk(conn, policy, CUTOFF, chunk, sleep=sleep)
        assert result.backoffs == len(pauses)
        assert result.rows_deleted == len(eligible)
        assert eligible_ids(primary, table) == []
        assert scalar(primary, f"SELECT count(*) FROM {table}") == total - len(eligible)
        row = ledger_chunk(primary, policy.ledger_schema, plan.run_key, chunk.key)
        assert (row["state"], row["rows_deleted"]) == ("complete", len(eligible))
        assert row["backoffs"] == first_pauses + result.backoffs
        # The standby replayed the purge: the same rows are gone there.
        wait_for(
            lambda: scalar(standby, f"SELECT count(*) FROM {table}") == total - len(eligible),
            15,
            "the standby to replay the purge",
        )
    finally:
        conn.close()
        standby.close()
        primary.close()
    assert time.monotonic() - started < 40
