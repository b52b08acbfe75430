"""The fenced code blocks of README.md and docs/*.md, with where each starts: the docs tests run them as
written, so an example cannot drift from the code.

A block may be marked, on the line right before its fence, with an HTML comment that MkDocs does not
render: ``<!-- example: fragment (why) -->`` for a deliberate fragment that cannot run on its own (the
tests only compile it, and list it with its reason). ``--8<--`` lines are snippet includes of files under
``dags/``, which their own tests run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
_MARKER = re.compile(r"^\s*<!--\s*example:\s*(?P<kind>[\w-]+)\s*(?:\((?P<why>.*)\))?\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: its file, the line of its opening fence (1-based), language and text."""

    path: Path
    line: int
    lang: str
    text: str
    marker: str | None = None  # the kind of an ``<!-- example: KIND (why) -->`` comment before the fence
    why: str | None = None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def include(self) -> bool:
        """A snippet include (``--8<-- "dags/..."``): the file it names is tested where it lives."""
        return self.text.lstrip().startswith("--8<--")


def blocks(*langs: str, files: list[Path] | None = None) -> list[Block]:
    """Every fenced block in ``langs`` (all when none given) of the docs files, in file order."""
    found: list[Block] = []
    for path in files or DOC_FILES:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            opening = _FENCE.match(lines[i])
            if opening is None:
                i += 1
                continue
            fence, indent = opening["fence"], len(opening["indent"])
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith(fence):
                end += 1
            body = "\n".join(line[indent:] for line in lines[i + 1 : end])
            previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = _MARKER.match(previous)
            lang = opening["lang"].lower()
            if not langs or lang in langs:
                found.append(
                    Block(
                        path=path,
                        line=i + 1,
                        lang=lang,
                        text=body + "\n",
                        marker=marker["kind"] if marker else None,
                        why=(marker["why"] or "").strip() if marker else None,
                    )
                )
            i = end + 1
    return found
