"""The error tree.

Two families, kept apart because they mean different things to the user::

    OverbrainerError            overbrainer could not run it: the user's input is wrong
    ├── PlanError               the plan file (field path + fix)
    ├── DataError               a conversation file (file:line + fix)
    ├── BaseModelError          the base model cannot be found, fetched or read
    └── RunStateError           a run folder is in a state the command cannot act on
    RunFailed                   the run itself ran and failed (training crashed)
    RunStopped                  the run was stopped on request, with a checkpoint

`OverbrainerError` exits with code 2, `RunFailed` with code 1. Both carry a one-line
message meant to be printed as is, without a traceback.
"""

from __future__ import annotations

__all__ = [
    "OverbrainerError",
    "PlanError",
    "DataError",
    "BaseModelError",
    "RunStateError",
    "RunFailed",
    "RunStopped",
]


class OverbrainerError(Exception):
    """The input is wrong; the message says what, where, and the fix. Exit code 2."""

    exit_code = 2


class PlanError(OverbrainerError):
    """The plan is invalid. Carries every problem found, not only the first."""

    def __init__(self, source: str, problems: list[str]):
        """`problems` are whole lines, each starting with its own ``file:line:``."""
        self.source = source
        self.problems = [p if p.startswith(source) else f"{source}: {p}" for p in problems]
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"{source}: {len(self.problems)} problems\n{lines}"
        super().__init__(message)


class DataError(OverbrainerError):
    """A conversation file is invalid at a given line."""

    def __init__(self, path: str, line: int | None, what: str, fix: str):
        self.path, self.line, self.what, self.fix = path, line, what, fix
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {what}; {fix}")


class BaseModelError(OverbrainerError):
    """The base model cannot be resolved, fetched or read."""


class RunStateError(OverbrainerError):
    """A run folder is in a state the command cannot act on."""


class RunFailed(Exception):
    """The run ran and failed: training crashed or was killed. Exit code 1."""

    exit_code = 1

    def __init__(self, message: str, log_tail: str = ""):
        self.log_tail = log_tail
        super().__init__(message)


class RunStopped(Exception):
    """The run stopped on request after saving a checkpoint: not an error. Exit code 0."""

    exit_code = 0
