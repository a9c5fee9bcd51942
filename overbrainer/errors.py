"""The error tree.

Two families, kept apart because they mean different things to the user::

    OverbrainerError            overbrainer could not run it: the user's input is wrong
    ├── PlanError               the plan file (field path + fix)
    ├── DataError               a conversation file (file:line + fix)
    ├── BaseModelError          the base model cannot be found, fetched or read
    ├── RunStateError           a run folder is in a state the command cannot act on
    ├── FileProblem             a file or folder cannot be read or written (path, what, fix)
    └── UsageError              the command line itself (an unknown option, a missing argument)
    RunFailed                   the run itself ran and failed (training crashed)
    RunStopped                  the run was stopped on request, with a checkpoint

`OverbrainerError` exits with code 2, `RunFailed` with code 1. Both carry a one-line
message meant to be printed as is, without a traceback. Each has a `kind` (``plan``,
``data``, ``base``, ``run_state``, ``file``, ``usage``, ``input``; ``run`` for `RunFailed`)
and a `where` (the file, ``file:line``, or None): what ``--json`` reports as
``{"error": {"kind", "message", "where"}}``.
"""

from __future__ import annotations

__all__ = [
    "OverbrainerError",
    "PlanError",
    "DataError",
    "BaseModelError",
    "RunStateError",
    "FileProblem",
    "UsageError",
    "RunFailed",
    "RunStopped",
]


class OverbrainerError(Exception):
    """The input is wrong; the message says what, where, and the fix. Exit code 2."""

    exit_code = 2
    kind = "input"
    where: str | None = None


class PlanError(OverbrainerError):
    """The plan is invalid. Carries every problem found, not only the first."""

    kind = "plan"

    def __init__(self, source: str, problems: list[str]):
        """`problems` are whole lines, each starting with its own ``file:line:``."""
        self.source = self.where = source
        self.problems = [p if p.startswith(source) else f"{source}: {p}" for p in problems]
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"{source}: {len(self.problems)} problems\n{lines}"
        super().__init__(message)


class DataError(OverbrainerError):
    """A conversation file is invalid at a given line."""

    kind = "data"

    def __init__(self, path: str, line: int | None, what: str, fix: str):
        self.path, self.line, self.what, self.fix = path, line, what, fix
        where = self.where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {what}; {fix}")


class BaseModelError(OverbrainerError):
    """The base model cannot be resolved, fetched or read."""

    kind = "base"


class RunStateError(OverbrainerError):
    """A run folder is in a state the command cannot act on."""

    kind = "run_state"


class FileProblem(OverbrainerError):
    """A file or folder cannot be used: which path, what failed, the fix, in one line."""

    kind = "file"

    def __init__(self, path: str, what: str, fix: str):
        self.where = str(path)
        super().__init__(f"{path}: {what}; {fix}")

    @classmethod
    def from_os_error(cls, e: OSError, doing: str = "") -> FileProblem:
        """An OSError as one line: its path, what the system said, and what usually fixes it."""
        import errno

        fixes = {
            errno.ENOTDIR: "a folder was expected there; move the file away or give another path",
            errno.EISDIR: "a file was expected there; give the file's path",
            errno.ENOENT: "check the path",
            errno.EEXIST: "move it away or give another path",
            errno.EACCES: "check its permissions, or give a path you can write",
            errno.EPERM: "check its permissions, or give a path you can write",
            errno.EROFS: "give a path on a writable disk",
            errno.ENOSPC: "free some disk space, then run the same command again",
            errno.EDQUOT: "free some disk space, then run the same command again",
        }
        path = e.filename if e.filename is not None else "(a file)"
        what = (e.strerror or str(e)).lower() if e.strerror else str(e)
        if doing:
            what = f"{what} (while {doing})"
        return cls(str(path), what, fixes.get(e.errno, "check the path and the disk"))


class UsageError(OverbrainerError):
    """The command line is wrong (argparse's message)."""

    kind = "usage"


class RunFailed(Exception):
    """The run ran and failed: training crashed or was killed. Exit code 1."""

    exit_code = 1
    kind = "run"
    where: str | None = None

    def __init__(self, message: str, log_tail: str = ""):
        self.log_tail = log_tail
        super().__init__(message)


class RunStopped(Exception):
    """The run stopped on request after saving a checkpoint: not an error. Exit code 0."""

    exit_code = 0
