"""How ``./dev test`` spreads the suite over pytest-xdist workers (``-n 2 --dist loadgroup``).

Each worker is a pytest process of its own, with its own databases, AIRFLOW_HOME and SQLite metadata
(tests/conftest.py draws their names per process). The tests that share a costly fixture run on one worker:
those of the shared Airflow deployment (the package fixture ``deployment`` of tests/deployment), those of the
Retention view's seeded ledger and api-server (tests/plugins), and those of a module with a module-scoped
fixture (a migrated metadata database, the newcomer's virtual environment, a Celery deployment, ...). Any other
test goes to whichever worker is free. The longest groups start first: the shared deployment's tests (mostly
waiting on Airflow), then the other scheduler and wheel tests; the short tests fill the end. Last come the few
tests marked ``solo`` that measure what the other workers would disturb (a wall-clock bound, the server's WAL):
one worker runs them once every other worker has finished.

pytest-xdist's own ``loadgroup`` carries a test's ``xdist_group`` mark to its controller inside the test's id,
which pytest 9.2 no longer lets it change (pytest-xdist issue 1386: the groups are silently lost). So each
worker writes the groups of the tests it collected to a file, and the controller's scheduler
(:func:`make_scheduler`, through ``pytest_xdist_make_scheduler``) reads them. ``xdist_group`` marks count too.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

GROUPS_ENV = "RETENTION_TEST_XDIST_GROUPS"  # the directory where the workers write their groups
SOLO_GROUP = "solo"
SHARED_FIXTURES = {
    "deployment": "deployment",  # tests/deployment/conftest.py: one Airflow deployment for the package
    "view_seeded": "view",  # tests/plugins/conftest.py: the seeded ledger (view_deployment uses it)
}


def group_of(item: pytest.Item) -> str | None:
    """The group of tests ``item`` must share a worker with, or None."""
    if item.get_closest_marker("solo") is not None:
        return SOLO_GROUP
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    names = getattr(item, "fixturenames", ())
    for fixture, group in SHARED_FIXTURES.items():
        if fixture in names:
            return group
    info = getattr(item, "_fixtureinfo", None)
    definitions = info.name2fixturedefs.values() if info is not None else ()
    if any(d.scope in ("module", "class") for defs in definitions for d in defs):
        return item.nodeid.split("::")[0]
    return None


def rank(item: pytest.Item, group: str | None) -> int:
    """Longest first: the shared deployment's tests (6 to 8 minutes), then the other deployments' and the
    newcomer's wheel, then everything else in collection order; the solo tests last."""
    if group == "deployment":
        return 0
    if group == SOLO_GROUP:
        return 3
    if item.get_closest_marker("scheduler") or item.get_closest_marker("wheel"):
        return 1
    return 2


def active(config: pytest.Config) -> bool:
    """``--dist loadgroup``: a worker has ``dist`` "no" and ``loadgroup`` True; a controller (or a single
    process run with -n 0) has ``dist`` "loadgroup"."""
    return bool(config.getoption("loadgroup", False)) or config.getoption("dist", "no") == "loadgroup"


def arrange(items: list[pytest.Item]) -> None:
    """Order ``items`` longest group first and, in a worker, write their groups for the controller."""
    groups: dict[str, str] = {}
    keys: dict[pytest.Item, tuple[int, int]] = {}
    for index, item in enumerate(items):
        group = group_of(item)
        if group is not None:
            groups[item.nodeid] = group
        keys[item] = (rank(item, group), index)
    items.sort(key=keys.__getitem__)
    directory, worker = os.environ.get(GROUPS_ENV), os.environ.get("PYTEST_XDIST_WORKER")
    if directory and worker:
        path = Path(directory) / f"{worker}.json"
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(groups))
        partial.replace(path)


_DIRECTORY = pytest.StashKey[str]()


def start_controller(config: pytest.Config) -> None:
    """Before the workers start (they inherit the environment): the directory they write their groups to."""
    if active(config) and getattr(config, "workerinput", None) is None:
        config.stash[_DIRECTORY] = os.environ[GROUPS_ENV] = tempfile.mkdtemp(prefix="retention-xdist-")


def stop_controller(config: pytest.Config) -> None:
    if _DIRECTORY in config.stash:
        shutil.rmtree(config.stash[_DIRECTORY], ignore_errors=True)
        os.environ.pop(GROUPS_ENV, None)


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's loadgroup scheduler, with the groups the workers wrote and their order kept."""
    from xdist.scheduler import LoadGroupScheduling

    class GroupScheduling(LoadGroupScheduling):  # type: ignore[misc]
        def __init__(self, config: pytest.Config, log: Any) -> None:
            super().__init__(config, log)
            config.option.loadscopereorder = False  # the workers' order: longest first (arrange)
            self._groups: dict[str, str] | None = None
            self._solo: Any = None  # the worker that runs the solo tests

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:  # first called once every worker has collected (and written its file)
                files = sorted(Path(os.environ.get(GROUPS_ENV, "/nonexistent")).glob("*.json"))
                if files:
                    self._groups = json.loads(files[0].read_text())
            group = (self._groups or {}).get(nodeid)
            if group == SOLO_GROUP:
                return f"{SOLO_GROUP}:{nodeid}"  # one unit per test, each alone
            return f"group:{group}" if group is not None else str(super()._split_scope(nodeid))

        def _solo_next(self) -> bool:
            return bool(self.workqueue) and next(iter(self.workqueue)).startswith(f"{SOLO_GROUP}:")

        def _assign_work_unit(self, node: Any) -> None:
            if self._solo_next():
                self._solo = self._solo or node
                if node is not self._solo:  # the first distribution: only one worker gets solo tests
                    return
            super()._assign_work_unit(node)

        def _reschedule(self, node: Any) -> None:
            if node.shutting_down:
                return
            if not self._solo_next():
                super()._reschedule(node)
                return
            # Only the solo tests are left (arrange puts them last): the first worker to ask runs them, once the
            # others have run their last tests and left. A worker runs its last test only once it gets more work
            # or is told to stop: so the others are told to stop now, and the solo worker waits for them.
            self._solo = self._solo or node
            for other in self.nodes:
                if other is not self._solo and not other.shutting_down:
                    other.shutdown()
            if node is self._solo and self.nodes == [node]:
                super()._assign_work_unit(node)

        def remove_node(self, node: Any) -> str | None:
            crashed = super().remove_node(node)
            if self._solo is not None and self._solo in self.assigned_work:
                self._reschedule(self._solo)  # the last of the others has left: the solo tests may start
            return crashed  # type: ignore[no-any-return]

    return GroupScheduling(config, log)
