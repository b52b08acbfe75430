"""Releases (issue 33): the version is written once, and CHANGELOG.md's newest release is that version,
with its breaking changes and ledger migrations listed first."""

from __future__ import annotations

import re
from pathlib import Path

import airflow_retention
from airflow_retention.core.ledger.schema import SCHEMA_VERSION

REPO = Path(__file__).resolve().parents[1]
SEMVER = re.compile(r"^\d+\.\d+\.\d+$")


def _releases() -> list[tuple[str, str]]:
    """(version, section text) of each release of CHANGELOG.md, newest first."""
    text = (REPO / "CHANGELOG.md").read_text()
    parts = re.split(r"^## (\S+) — \d{4}-\d{2}-\d{2}\n", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def test_the_version_is_written_once_and_is_semantic() -> None:
    assert SEMVER.match(airflow_retention.__version__), airflow_retention.__version__
    # Read as text (tomllib is Python 3.11+): no literal version in [project], setuptools reads the attribute.
    pyproject = (REPO / "pyproject.toml").read_text()
    project = pyproject.split("[project]", 1)[1].split("\n[", 1)[0]
    assert not re.search(r"^version\s*=", project, re.M)
    assert re.search(r'^dynamic = \[.*"version".*\]', project, re.M)
    assert 'version = { attr = "airflow_retention.__version__" }' in pyproject


def test_the_changelog_names_the_current_version_first() -> None:
    releases = _releases()
    assert releases, "CHANGELOG.md has no '## X.Y.Z — YYYY-MM-DD' section"
    assert releases[0][0] == airflow_retention.__version__
    versions = [tuple(int(n) for n in v.split(".")) for v, _ in releases]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions)


def test_each_release_lists_breaking_changes_then_ledger_migrations_first() -> None:
    for version, body in _releases():
        headings = re.findall(r"^### (.+)$", body, re.M)
        kept = [h for h in headings if h.startswith(("Breaking changes", "Ledger migrations"))]
        assert headings[: len(kept)] == kept, (version, headings)


def _unreleased() -> str | None:
    """The text of the ``## Unreleased`` section above the newest release, if there is one."""
    head = re.split(r"^## \S+ — \d{4}-\d{2}-\d{2}\n", (REPO / "CHANGELOG.md").read_text(), maxsplit=1, flags=re.M)[0]
    found = re.search(r"^## Unreleased\n(.*)", head, re.M | re.S)
    return found.group(1) if found else None


def test_the_current_ledger_version_has_its_migration_in_the_changelog() -> None:
    # A migration not yet released is listed under "Unreleased"; once released, in its release.
    newest = _unreleased() or _releases()[0][1]
    assert f"→ {SCHEMA_VERSION}" in newest or f"Version {SCHEMA_VERSION}:" in newest
