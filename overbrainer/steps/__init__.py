"""The steps of a bake, and the one driver that runs any of them.

Each step is a module with::

    NAME: str          the step's name in the graph
    VERSION: int       bumped when its code changes what it writes (part of the fingerprint)
    TARGETS: list      the files it makes, relative to the run folder (documentation)
    inputs(bake)       -> dict: everything the step reads, JSON-able: its fingerprint
    run(bake, inputs)  -> Outputs: does the work
    reuse_note(bake, inputs, fingerprint) -> str | None   (optional) what of its partial
                       outputs a rerun goes on from, added to why it runs

Every step is given a `context.Bake` (the compiled plan, where things are, and how to speak
to the user); it never imports the bake driver (``graph/``). `inputs` reads upstream stamps
(cheap: small JSON files) and raises `NotReady` when one is missing. `check` says whether a
step is up to date, once per step per bake (doit's up-to-date check computes it, `execute`
takes it); `execute` is the only place that decides to skip, deletes the stamp before the
work, and writes it after.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

from ..stamps import Stamp, diff_inputs, fingerprint, read_stamp, verify, write_stamp

if TYPE_CHECKING:
    from .context import Bake

__all__ = ["Outputs", "NotReady", "Status", "check", "execute", "upstream"]


@dataclass
class Outputs:
    entries: list[str]  # files or folders, relative to `root`
    root: str = ""  # "" is the run folder
    summary: dict = field(default_factory=dict)


class NotReady(Exception):
    """An upstream step has no stamp yet."""

    def __init__(self, step: str):
        self.step = step
        super().__init__(f"{step} has not run")


@dataclass
class Status:
    up_to_date: bool
    reason: str
    fingerprint: str | None = None
    inputs: dict | None = None


def upstream(bake: Bake, step: str) -> Stamp:
    """The stamp of a step this one reads, which must exist."""
    stamp = read_stamp(bake.folder.stamp(step))
    if stamp is None:
        raise NotReady(step)
    return stamp


def check(bake: Bake, module: ModuleType) -> Status:
    """Whether a step is up to date, and if not, why (in words a user can act on). The
    answer is kept on the bake for `execute`, which runs right after it."""
    status = bake.checked[module.NAME] = _check(bake, module)
    return status


def _check(bake: Bake, module: ModuleType) -> Status:
    status = _compare(bake, module)
    note = getattr(module, "reuse_note", None)
    if not status.up_to_date and status.inputs is not None and note is not None:
        # what of its partial outputs a step that reruns goes on from (train: the
        # checkpoints of the stable phase that another length shares)
        said = note(bake, status.inputs, status.fingerprint)
        if said:
            status.reason = f"{status.reason}; {said}"
    return status


def _compare(bake: Bake, module: ModuleType) -> Status:
    try:
        inputs = module.inputs(bake)
    except NotReady as e:
        return Status(False, f"waits for {e.step}")
    fp = fingerprint(module.NAME, module.VERSION, inputs)
    stamp = read_stamp(bake.folder.stamp(module.NAME))
    if stamp is None:
        return Status(False, "not done yet", fp, inputs)
    if stamp.fingerprint != fp:
        if stamp.version != module.VERSION:
            return Status(False, f"its code changed (version {stamp.version} → {module.VERSION})", fp, inputs)
        changes = diff_inputs(stamp.inputs, inputs)
        return Status(False, "; ".join(changes) or "its inputs changed", fp, inputs)
    problem = verify(stamp, bake.hashes, bake.folder.root)
    if problem:
        return Status(False, problem, fp, inputs)
    return Status(True, "up to date", fp, inputs)


def execute(bake: Bake, module: ModuleType) -> bool:
    """Run a step unless it is up to date. Returns True when it did work."""
    status = bake.checked.pop(module.NAME, None) or check(bake, module)
    bake.checked.pop(module.NAME, None)
    if status.up_to_date:
        bake.hashes.save()
        return False
    if status.fingerprint is None:
        raise NotReady(status.reason)
    stamp_path = bake.folder.stamp(module.NAME)
    # the stamp goes first: from here until the new one is written the step is not done,
    # whatever its partial outputs look like
    stamp_path.unlink(missing_ok=True)
    bake.say(f"{module.NAME}: {status.reason}")
    bake.tell(task=module.NAME, why=status.reason)  # a follower's line: this step begins, and why
    bake.validate()
    out = module.run(bake, status.inputs)
    from ..stamps import manifest

    root = bake.folder.root / out.root  # "" is the run folder; a branch's root is relative to it
    files = manifest(root, out.entries, bake.hashes)
    write_stamp(
        stamp_path,
        Stamp(
            step=module.NAME,
            version=module.VERSION,
            fingerprint=status.fingerprint,
            inputs=status.inputs,
            root=out.root,
            outputs=files,
            summary=out.summary,
        ),
    )
    bake.hashes.save()
    return True
