"""Every ``python`` and ``yaml`` example of README.md and docs/*.md, run as written against a throwaway
database holding the tables the examples name (tests/docs/conftest.py), so that an example can no longer
drift from the code. A failure names the file and the line of the block's opening fence.

How each block is run:

- a YAML policies file (``policies:``) is loaded with the package's loader (``load_policies``, which
  validates every field) and each policy is planned (a dry-run plan: ``compute_plan``, which writes
  nothing) against the example tables;
- a YAML ``defaults:`` block (a fragment of a policies file, as the docs present it) is loaded under a
  minimal policy, and that policy planned;
- a Python program is executed in a namespace of its own, with the current directory at the repository's
  root, ``__file__`` a DAG file in ``dags/`` and the connections ``retention_target`` and
  ``retention_admin`` pointing at the example database; every ``RetentionPolicy`` it leaves in its
  namespace is planned;
- a Python call signature (``RetentionChunkOperator(*, policy: RetentionPolicy, ...)``) is compared
  with the real signature: names, order, kinds, defaults;
- a Python value (a dict or a list) is evaluated; tests/docs/test_xcoms.py compares the documented
  XComs and ``task_defaults`` with what a real run pushes;
- ``--8<--`` snippet includes name files under ``dags/``, which tests/provider runs: only their
  existence is checked here;
- a block marked ``<!-- example: fragment (why) -->`` right before its fence is only compiled (it needs a context it names).
  The marked fragments are listed in FRAGMENTS, so that a new one is a visible change.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import tokenize
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml

from airflow_retention.core.planning.cutoff import freeze_cutoff
from airflow_retention.core.planning.planner import compute_plan
from airflow_retention.core.policy.loading import load_policies
from airflow_retention.core.policy.model import RetentionPolicy
from airflow_retention.demo.postgres import airflow_connection_json

from .conftest import RUN_DATE
from .markdown import REPO, Block, blocks

# Every deliberate fragment, by file, with why it cannot run on its own (the reason is also in the Markdown).
FRAGMENTS = {
    "docs/operators.md": 1,  # the body of a task of your own: `ti` is the running task instance
}
# A fragment's defaults are loaded under this policy, on a table of the examples.
BASE_POLICY = {
    "name": "docs_defaults_fragment",
    "conn_id": "retention_target",
    "table": "public.webhook_deliveries",
    "key_column": "id",
    "timestamp_column": "created_at",
    "retention": "30 days",
}
# Where the documented signatures live.
MODULES = [
    "airflow_retention",
    "airflow_retention.dag_factory",
    "airflow_retention.operators.retention",
    "airflow_retention.sensors.retention",
    "airflow_retention.triggers.retention",
    "airflow_retention.hooks.retention",
]
AIRFLOW_HINTS = ("airflow.", "RetentionHook", "dag_factory", "operators", "sensors", "triggers", "hooks")


def kind(block: Block) -> str:
    if block.marker is not None:
        return block.marker
    if block.include:
        return "include"
    if block.lang in ("yaml", "yml"):
        doc = yaml.safe_load(block.text)
        if isinstance(doc, dict) and "policies" in doc:
            return "policies"
        if isinstance(doc, dict) and set(doc) == {"defaults"}:
            return "defaults"
        if isinstance(doc, dict) and set(doc) == {"airflow_metadata"}:
            return "metadata"
        return "yaml?"
    try:
        tree = ast.parse(block.text)
    except SyntaxError:
        return "signature" if _signature_parts(block.text) is not None else "python?"
    if (
        len(tree.body) == 1
        and isinstance(tree.body[0], ast.Expr)
        and isinstance(tree.body[0].value, (ast.Dict, ast.List))
    ):
        return "value"
    return "program"


def examples() -> list[Any]:
    params = []
    for block in blocks("python", "py", "yaml", "yml"):
        marks = []
        if block.lang in ("python", "py") and any(h in block.text for h in AIRFLOW_HINTS):
            marks.append(pytest.mark.airflow)
        params.append(pytest.param(block, id=block.where, marks=marks))
    return params


@pytest.fixture
def example_env(example_dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The examples' connections point at the example database; paths are read from the repository."""
    for conn_id in ("retention_target", "retention_admin"):
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", airflow_connection_json(example_dsn))
    monkeypatch.chdir(REPO)
    return example_dsn


def plan(dsn: str, policy: RetentionPolicy, where: str) -> None:
    """A dry-run plan of ``policy`` for the examples' run date: reads only, writes nothing."""
    conn = psycopg2.connect(dsn)
    try:
        compute_plan(conn, policy, freeze_cutoff(policy, RUN_DATE), run_date=RUN_DATE)
    except Exception as exc:
        raise AssertionError(f"{where}: policy {policy.name!r} does not plan: {exc}") from exc
    finally:
        conn.close()


def load_yaml(text: str, tmp_path: Path, where: str) -> list[RetentionPolicy]:
    path = tmp_path / "policies.yaml"
    path.write_text(text)
    try:
        return load_policies(path)
    except Exception as exc:
        raise AssertionError(f"{where}: the policies do not load: {exc}") from exc


def _signature_parts(text: str) -> tuple[str, str] | None:
    """``(name, "def name(...): ...")`` of a documented signature ``Name(params) [-> T]``, comments removed."""
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type != tokenize.COMMENT]
        code = tokenize.untokenize(tokens)
    except (tokenize.TokenError, IndentationError):
        return None
    head = code.lstrip()
    name = head.split("(", 1)[0].strip()
    if not name.isidentifier() or "(" not in head:
        return None
    depth, end = 0, None
    for i, ch in enumerate(head):
        depth += ch == "("
        depth -= ch == ")"
        if ch == ")" and depth == 0:
            end = i
            break
    if end is None or (head[end + 1 :].strip() and not head[end + 1 :].strip().startswith("->")):
        return None
    return name, f"def {name}{head[len(name) : end + 1]}: ..."


def _real(name: str) -> Any:
    for module in MODULES:
        found = getattr(importlib.import_module(module), name, None)
        if found is not None:
            return found
    raise AssertionError(f"{name} is in none of {', '.join(MODULES)}")


def check_signature(block: Block) -> None:
    parts = _signature_parts(block.text)
    assert parts is not None
    name, source = parts
    documented = ast.parse(source).body[0].args
    real = inspect.signature(_real(name))
    kinds = inspect.Parameter
    doc_params: list[tuple[str, Any, object]] = []
    positional = [*documented.posonlyargs, *documented.args]
    pos_defaults = [None] * (len(positional) - len(documented.defaults)) + list(documented.defaults)
    for arg, default in zip(positional, pos_defaults, strict=True):
        doc_params.append((arg.arg, kinds.POSITIONAL_OR_KEYWORD, default))
    if documented.vararg is not None:
        doc_params.append((documented.vararg.arg, kinds.VAR_POSITIONAL, None))
    for arg, default in zip(documented.kwonlyargs, documented.kw_defaults, strict=True):
        doc_params.append((arg.arg, kinds.KEYWORD_ONLY, default))
    if documented.kwarg is not None:
        doc_params.append((documented.kwarg.arg, kinds.VAR_KEYWORD, None))
    real_params = list(real.parameters.values())
    assert [(n, k) for n, k, _ in doc_params] == [(p.name, p.kind) for p in real_params], (
        f"{block.where}: the documented signature of {name} is not the code's: documented"
        f" {[(n, str(k)) for n, k, _ in doc_params]}, code {[(p.name, str(p.kind)) for p in real_params]}"
    )
    for (param, _, default), actual in zip(doc_params, real_params, strict=True):
        if default is None:
            assert actual.default is inspect.Parameter.empty or actual.kind in (
                kinds.VAR_POSITIONAL,
                kinds.VAR_KEYWORD,
            ), f"{block.where}: {name}({param}) has a default in the code ({actual.default!r}), none in the docs"
            continue
        try:
            value = ast.literal_eval(default)
        except ValueError:
            continue  # an expression the docs spell in words
        assert actual.default == value, (
            f"{block.where}: {name}({param}) defaults to {actual.default!r} in the code, {value!r} in the docs"
        )


def run_program(block: Block, dsn: str) -> None:
    namespace: dict[str, Any] = {
        "__name__": f"docs_example_{block.line}",
        "__file__": str(REPO / "dags" / "example.py"),
    }
    try:
        exec(compile(block.text, block.where, "exec"), namespace)
    except Exception as exc:
        raise AssertionError(f"{block.where}: the example fails as written: {type(exc).__name__}: {exc}") from exc
    named: list[RetentionPolicy] = []
    for value in namespace.values():
        if isinstance(value, RetentionPolicy):
            named.append(value)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, RetentionPolicy) for v in value):
            named.extend(value)
    for policy in {id(p): p for p in named}.values():
        plan(dsn, policy, block.where)


@pytest.mark.parametrize("block", examples())
def test_every_docs_example_runs_as_written(block: Block, example_env: str, tmp_path: Path) -> None:
    what = kind(block)
    if what == "fragment":
        assert block.why, f"{block.where}: a fragment marker gives its reason: <!-- example: fragment (why) -->"
        # Not runnable alone (it names a task's context), but it must still be valid Python: a skip would
        # count as a failure here, and a syntax slip in a fragment is still a broken example.
        compile(block.text, block.where, "exec")
        return
    if what == "metadata":
        # Policies of Airflow's own tables: built here, planned and run in a metadata database by
        # tests/metadata/test_side_by_side.py.
        from airflow_retention.metadata import metadata_policies, parse_settings

        if block.lang in ("python", "py"):
            namespace: dict[str, Any] = {"__name__": f"docs_example_{block.line}"}
            exec(compile(block.text, block.where, "exec"), namespace)
            assert namespace.get("policies"), f"{block.where}: no policy"
            return
        settings = parse_settings(yaml.safe_load(block.text), block.where)
        assert metadata_policies(settings), f"{block.where}: no table"
        return
    if what == "partman":
        # Needs pg_partman and the page's own table: tests/partman/test_docs.py plans and runs it there.
        assert block.why, f"{block.where}: a partman marker says where it runs: <!-- example: partman (why) -->"
        assert load_yaml(block.text, tmp_path, block.where), f"{block.where}: no policy"
        return
    if what == "include":
        included = block.text.strip().split(None, 1)[1].strip().strip('"')
        assert (REPO / included).is_file(), f"{block.where}: includes {included}, which does not exist"
        assert included.startswith("dags/"), f"{block.where}: includes {included}, outside dags/ (not tested)"
        return
    if what == "policies":
        policies = load_yaml(block.text, tmp_path, block.where)
        assert policies, f"{block.where}: no policy"
        for policy in policies:
            plan(example_env, policy, block.where)
        return
    if what == "defaults":
        defaults = yaml.safe_load(block.text)["defaults"]
        text = yaml.safe_dump({"defaults": defaults, "policies": [BASE_POLICY]})
        (policy,) = load_yaml(text, tmp_path, block.where)
        plan(example_env, policy, block.where)
        return
    if what == "signature":
        check_signature(block)
        return
    if what == "value":
        from datetime import timedelta

        policy = RetentionPolicy.from_dict({**BASE_POLICY, "queue": "retention"})
        eval(compile(block.text, block.where, "eval"), {"policy": policy, "timedelta": timedelta})
        return
    if what == "program":
        run_program(block, example_env)
        return
    pytest.fail(
        f"{block.where}: a {block.lang} block of no known kind ({what}): make it runnable, or mark it"
        " <!-- example: fragment (why) --> and add it to FRAGMENTS"
    )


def test_the_fragments_are_the_listed_ones() -> None:
    marked: dict[str, int] = {}
    for block in blocks("python", "py", "yaml", "yml"):
        if block.marker == "fragment":
            file = block.where.split(":")[0]
            marked[file] = marked.get(file, 0) + 1
    assert marked == FRAGMENTS


def test_the_examples_are_found() -> None:
    """The extraction itself: the README's two examples and the docs' YAML and Python are all seen."""
    found = blocks("python", "py", "yaml", "yml")
    files = {b.where.split(":")[0] for b in found}
    assert {"README.md", "docs/policies.md", "docs/operators.md", "docs/ledger.md", "docs/deployment.md"} <= files
    assert len(found) >= 20
