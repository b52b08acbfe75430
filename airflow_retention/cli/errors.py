"""The errors the command reports in one line, with its exit code, instead of a traceback."""

from __future__ import annotations

EXIT_OK = 0
EXIT_INCOMPLETE = 1
EXIT_ERROR = 2


class CliError(Exception):
    """An expected failure (bad option, unknown policy, unreachable database): one line, exit 2."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code
