"""docs/partman.md as written: its SQL (the set, partman's maintenance, the roles and grants) run against a
database of its own, its policy loaded from its YAML and run as the purge role the page grants to, and the
refusal it quotes checked against the planner's message. Role names are replaced by roles of the test's
own (roles are the server's, not the database's)."""

from __future__ import annotations

import re
import uuid
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from psycopg2.extensions import make_dsn

from airflow_retention.core.errors import PermanentError
from airflow_retention.core.policy.loading import load_policies
from tests.conftest import throwaway_database
from tests.docs.markdown import REPO, Block, blocks

from .helpers import TODAY, Partman

DOC = REPO / "docs" / "partman.md"
ROLES = ("app_owner", "retention_purger")


def block_with(found: list[Block], lang: str, needle: str) -> Block:
    (block,) = [b for b in found if b.lang == lang and needle in b.text]
    return block


def test_the_partman_page_runs_as_written(tmp_path: Path) -> None:
    found = blocks("sql", "yaml", "text", files=[DOC])
    setup = block_with(found, "sql", "partman.create_parent")
    maintenance = block_with(found, "sql", "partman.run_maintenance")
    grants = block_with(found, "sql", "GRANT")
    policies = block_with(found, "yaml", "policies:")
    refusal = block_with(found, "text", "field 'detached_schema'")
    suffix = uuid.uuid4().hex[:8]
    names = {role: f"{role}_{suffix}" for role in ROLES}

    def renamed(sql: str) -> str:
        for role, name in names.items():
            sql = re.sub(rf"\b{role}\b", name, sql)
        return sql

    with throwaway_database("retention_partman_docs") as dsn:
        pm = Partman(dsn)
        try:
            pm.q(setup.text)
            total = pm.fill("events_daily", TODAY - timedelta(days=60), TODAY)
            pm.q(renamed(grants.text))
            # The set owned by the role partman's maintenance runs as (the page's app_owner).
            for (rel,) in pm.q("SELECT relid::regclass::text FROM pg_partition_tree('public.events_daily')"):
                pm.q(f'ALTER TABLE {rel} OWNER TO "{names["app_owner"]}"')
            (policy,) = load_policies(_write(tmp_path, policies.text))

            purger = Partman(make_dsn(dsn, user=names["retention_purger"]))
            try:
                # Without detached_schema the page says the plan is refused, and how.
                with pytest.raises(PermanentError) as err:
                    purger.plan(replace(policy, detached_schema=None))
                quoted = " ".join(refusal.text.split()).split(" … ")
                message = " ".join(str(err.value).split())
                assert message.startswith(quoted[0]) and message.endswith(quoted[-1]), (quoted, message)
                assert pm.one("SELECT count(*) FROM public.events_daily") == total

                purge = purger.purge(policy)
            finally:
                purger.close()
            left = pm.ids("public.events_daily")
            assert left == pm.ids("public.events_daily", "created_at >= %(c)s", {"c": purge.cutoff}) and left
            assert list(purge.outcomes.values()).count("detached") >= 29
            assert len(pm.tables_in("retention_detached")) >= 29
            # The page's maintenance: partman's run and its DEFAULT check, both clean after the purge.
            with pm.admin.cursor() as cur:
                cur.execute(maintenance.text)
                assert cur.fetchall() == []
        finally:
            for name in names.values():
                if pm.q("SELECT 1 FROM pg_roles WHERE rolname = %(r)s", {"r": name}):
                    pm.q(f'DROP OWNED BY "{name}" CASCADE')
            pm.close()
    for name in names.values():
        Partman.drop_role(name)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policies.yaml"
    path.write_text(text)
    return path
