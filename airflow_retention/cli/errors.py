"""The errors the command reports in one line, with its exit code, instead of a traceback."""

from __future__ import annotations

EXIT_OK = 0
EXIT_INCOMPLETE = 1
EXIT_ERROR = 2
# ``status``: a policy is failing (an invalid entry in the policies file, a database that cannot be reached,
# a target check that fails, or a latest run stopped on an error).
EXIT_FAILING = 3


def first_line(exc: BaseException) -> str:
    """An error's first line (a driver's detail lines stay out of one-line messages)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class CliError(Exception):
    """An expected failure (bad option, unknown policy, unreachable database): one line, exit 2."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code
