"""A month of nights beside pg_partman, as a deployment lives it: every night the day's rows arrive (some
late, for days long gone), partman's maintenance runs, now and then partman's ``partition_data_time``
moves the DEFAULT's late rows into days it recreates, and the retention run of that night detaches the
expired days into ``retention_detached``. After every night: partman's maintenance and DEFAULT check
succeed, the live table holds exactly the rows of the last 7 days, and no row is lost: every row inserted
is live, in a detached table, or a late row of the DEFAULT partition deleted in a batch."""

from __future__ import annotations

from datetime import timedelta

from .helpers import TODAY, Partman, days_ago

NIGHTS = 30


def test_a_month_of_nights_with_partman_maintenance_and_late_rows(pm: Partman) -> None:
    start = days_ago(NIGHTS + 20)
    pm.create_time_set("ev_nightly", "daily", start=start, premake=4)
    inserted = pm.fill("ev_nightly", start, days_ago(NIGHTS), "2 hours")
    policy = pm.policy(
        "ev_nightly", retention="7 days", expired_partitions="detach", detached_schema="retention_detached"
    )
    renamed = deleted = 0
    for night in range(NIGHTS):
        day = TODAY - timedelta(days=NIGHTS - night - 1)  # the run of this night is anchored at its midnight
        inserted += pm.fill("ev_nightly", day - timedelta(days=1), day, "2 hours")
        if night % 4 == 3:  # a late row for a day detached nights ago: partman's DEFAULT takes it
            pm.q(
                "INSERT INTO public.ev_nightly (created_at, status) VALUES (%(t)s, 'closed')",
                {"t": day - timedelta(days=12, hours=-3)},
            )
            inserted += 1
        if night % 8 == 7:  # partman moves the DEFAULT's rows into the days it recreates for them
            pm.q("SELECT partman.partition_data_time('public.ev_nightly', p_batch_count => 100)")
        pm.maintain()
        before = len(pm.tables_in("retention_detached"))
        purge = pm.purge(policy, day)
        # Late rows left in the DEFAULT (it cannot be detached) are deleted in batches.
        deleted += sum(r.rows_deleted for r in purge.results if not r.chunk_key.startswith("detach:"))
        renamed += sum(1 for t in pm.tables_in("retention_detached") if t.endswith("_1"))
        # Exactly the rows of the last 7 days are live; every other row is in a detached table.
        live = pm.one("SELECT count(*) FROM public.ev_nightly")
        assert live == pm.one("SELECT count(*) FROM public.ev_nightly WHERE created_at >= %(c)s", {"c": purge.cutoff})
        assert pm.one("SELECT count(*) FROM public.ev_nightly WHERE created_at < %(c)s", {"c": purge.cutoff}) == 0
        detached = sum(
            int(pm.one(f'SELECT count(*) FROM retention_detached."{t}"')) for t in pm.tables_in("retention_detached")
        )
        assert live + detached + deleted == inserted, f"night {night}: {live} + {detached} + {deleted} != {inserted}"
        assert len(pm.tables_in("retention_detached")) >= before + (1 if night else 0)
        pm.maintain()
        assert pm.check_default() == {}, f"night {night}"
    # The late rows that partman put back into recreated days were detached again under new names.
    assert renamed > 0
    assert pm.one("SELECT count(*) FROM public.ev_nightly WHERE created_at < %(c)s", {"c": days_ago(7)}) == 0
