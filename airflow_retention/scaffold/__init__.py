"""The files a dags folder needs, shipped with the package: ``retention_dags.py`` (one DAG per policy) and
``retention_policies.yaml`` (commented example policies), which ``airflow-retention init DAGS_FOLDER``
writes and the demo runs (the repository's ``dags/`` holds links to these same files); and, for Airflow's
own metadata database, ``retention_airflow_metadata.py`` and ``retention_airflow_metadata.yaml``, which
``init --airflow-metadata`` writes."""

from __future__ import annotations

from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

DAG_FILE = "retention_dags.py"
POLICIES_FILE = "retention_policies.yaml"
FILES = (DAG_FILE, POLICIES_FILE)
METADATA_DAG_FILE = "retention_airflow_metadata.py"
METADATA_SETTINGS_FILE = "retention_airflow_metadata.yaml"
METADATA_FILES = (METADATA_DAG_FILE, METADATA_SETTINGS_FILE)


class ScaffoldExistsError(FileExistsError):
    """A file ``init`` would write is already there, and ``force`` was not given."""


def source(name: str) -> str:
    """The text of one scaffold file, as shipped in the package."""
    if name not in FILES + METADATA_FILES:
        raise ValueError(f"no scaffold file {name!r}: one of {', '.join(FILES + METADATA_FILES)}")
    return (files(__name__) / name).read_text(encoding="utf-8")


def write_scaffold(dags_folder: Path, *, force: bool = False, names: Sequence[str] = FILES) -> list[Path]:
    """Write the DAG file and the policies file into ``dags_folder`` (created if missing).

    Checks every file before writing any, so a refusal leaves the folder as it was.

    :param dags_folder: the Airflow dags folder.
    :param force: overwrite files that exist.
    :param names: which files (:data:`FILES`, or :data:`METADATA_FILES` for the metadata database).
    :return: the paths written.
    """
    if dags_folder.exists() and not dags_folder.is_dir():
        raise NotADirectoryError(f"{dags_folder} is not a directory")
    targets = [dags_folder / name for name in names]
    if not force:
        for target in targets:
            if target.exists() or target.is_symlink():
                raise ScaffoldExistsError(f"{target} already exists; not overwritten (--force overwrites it)")
    dags_folder.mkdir(parents=True, exist_ok=True)
    for name, target in zip(names, targets, strict=True):
        if target.is_symlink():
            target.unlink()  # writing through a link would change the file it points to
        target.write_text(source(name), encoding="utf-8")
    return targets


def next_steps(dags_folder: Path, policies: Sequence[Any], date: str) -> list[str]:
    """What to do after ``init``: the connections and pools the policies name, then a dry run.

    :param dags_folder: where the files were written.
    :param policies: the policies of the written YAML file.
    :param date: the run date to show in the dry-run command (``YYYY-MM-DD``).
    """
    policies_file = dags_folder / POLICIES_FILE
    steps = [f"Edit {policies_file}: name your own tables (every key: docs/policies.md)."]
    for conn_id in sorted({p.conn_id for p in policies}):
        steps.append(
            f"Create the connection {conn_id} to the database to purge:\n"
            f"    airflow connections add {conn_id} --conn-uri 'postgresql://USER:PASSWORD@HOST:5432/DBNAME'"
        )
    pools = sorted({p.pool for p in policies if p.pool})
    if pools:
        for pool in pools:
            steps.append(
                f'Create the pool {pool} (slots = concurrent chunk tasks):\n    airflow pools set {pool} 4 "retention"'
            )
    else:
        steps.append('No policy names a pool; one that sets pool: NAME needs it: airflow pools set NAME 4 "retention"')
    if policies:
        first = policies[0].name
        steps.append(
            "A dry run, which writes nothing (the plan of the run of that date):\n"
            f"    airflow-retention --policies {policies_file} plan {first} --date {date}"
        )
        # `dags list` reads the metadata database, empty until the dag-processor parses the folder; reserialize
        # parses it now (Airflow 3.0 and later), so the list and the unpause work on a fresh install too.
        steps.append(
            "Check that Airflow sees the DAGs (reserialize parses the folder now, without waiting for the"
            " dag-processor), then unpause them:\n"
            "    airflow dags reserialize\n"
            f"    airflow dags list | grep retention_\n    airflow dags unpause retention_{first}"
        )
    return steps


def metadata_next_steps(dags_folder: Path, settings: Any) -> list[str]:
    """What to do after ``init --airflow-metadata``: the role and connection, then parse and unpause."""
    return [
        f"Edit {dags_folder / METADATA_SETTINGS_FILE}: the retention ({settings.retention}), per-DAG retention,"
        " the tables (docs/airflow-metadata.md).",
        "Create a role of its own in the metadata database and its grants (docs/airflow-metadata.md, Setup), then"
        f" the connection {settings.conn_id} as that role:\n"
        f"    airflow connections add {settings.conn_id} --conn-uri"
        " 'postgresql://retention_metadata:PASSWORD@HOST:5432/AIRFLOW_DB'",
        "Check that Airflow sees the DAG, then unpause it (and stop any airflow db clean job of yours):\n"
        "    airflow dags reserialize\n"
        "    airflow dags list | grep retention_airflow_metadata\n"
        "    airflow dags unpause retention_airflow_metadata",
    ]
