"""Plan → doit tasks: the one place that knows the order of the steps.

::

    plan ─► resolve ─► plan.json (every setting, every input pinned)
    plan ─► base  ─► the base model (cache) ─┐
    plan ─► split ─► examples.parquet ───────┴─► config ─► config.yaml ─► train ─► checkpoints/
                                                      ─► merge ─► merged/ ─► bake ─► baked/

A step depends on the steps whose outputs it reads: base and split read only the plan and
its input files, so editing a training setting never makes them wait for anything.

A plan with ``train.budgets`` trains the trunk (the stable phase) once, and each budget b is
a branch of its own after it (``steps/branch.py``), in place of merge and bake::

    train ─► decay@b ─► branches/b/checkpoints/ ─► merge@b ─► branches/b/merged/ ─► bake@b ─► branches/b/baked/

and so is each branch ``overbrainer decay --at s`` made (``decay@at-s``, ...). `graph_of`
gives a bake's steps and what each reads; `STEPS` and `DEPS` are the single-budget graph.

Compiling is pure: it builds task dictionaries and reads nothing but stamps (when doit asks
whether a task is up to date). Running them is doit's job (``build.py``, ``dodo.py``).
Every task is a subtask of the group ``train``, so ``doit train plan=...`` runs it all, and
``doit list --all`` shows ``train:split``, ``train:config``, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

from ..steps import bake as bake_step
from ..steps import base_model as base_step
from ..steps import branch, check, config, execute, merge, resolve, split, train
from ..steps.on_slurm import placed

if TYPE_CHECKING:
    from ..steps.context import Bake

__all__ = ["STEPS", "DEPS", "GROUP", "Outcome", "doit_tasks", "step", "graph_of"]

GROUP = "train"
STEPS = (resolve, base_step, split, config, train, merge, bake_step)
DEPS: dict[str, tuple[str, ...]] = {
    "resolve": (),
    "base": (),
    "split": (),
    "config": ("base", "split"),
    "train": ("config",),
    "merge": ("train",),
    "bake": ("merge",),
}


@dataclass
class Outcome:
    """What a bake did: the steps it ran and those already done, in order, and the error
    that ended it (None: it went through). `code` is the bake's exit code (the driver's
    `exit_code`; doit's own under ``doit``); `signalled`, the signal that asked it to stop."""

    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    error: BaseException | None = None
    code: int = 0
    signalled: int | None = None


TRUNK = (resolve, base_step, split, config, train)


def graph_of(bake: Bake | None = None) -> tuple[list, dict[str, tuple[str, ...]]]:
    """A bake's steps in order, and the steps each reads: `STEPS` and `DEPS`, but with the
    plan's budgets (which replace merge and bake) and the branches made by ``decay --at``.
    Reads the plan and the names in ``branches/``, nothing else."""
    if bake is None:
        return list(STEPS), dict(DEPS)
    labels = branch.labels(bake)
    budgets = getattr(bake.plan.train, "budgets", None)
    steps = list(TRUNK if budgets else STEPS)
    deps = {m.NAME: DEPS[m.NAME] for m in steps}
    for label in labels:
        decay, merge_b, bake_b = branch.steps_of(label)
        steps += [decay, merge_b, bake_b]
        deps.update({decay.NAME: ("train",), merge_b.NAME: (decay.NAME,), bake_b.NAME: (merge_b.NAME,)})
    return steps, deps


def step(name: str, bake: Bake | None = None):
    for module in graph_of(bake)[0]:
        if module.NAME == name:
            return module
    raise KeyError(name)


def downstream(name: str, bake: Bake | None = None) -> list[str]:
    """Every step that reads, directly or not, what `name` writes, in order."""
    steps, deps = graph_of(bake)
    out: list[str] = []
    for module in steps:
        if any(d == name or d in out for d in deps[module.NAME]):
            out.append(module.NAME)
    return out


class _UpToDate:
    """A step's doit ``uptodate`` check: its stamp, and the steps before it. Its repr is the
    reason, so that ``doit info`` says why a step would run, in the words of ``bake
    --dry-run`` and ``overbrainer why`` ("after config": a step before it will run first,
    and change what it reads). A step before it that this doit run has already run or
    skipped is up to date now; one it has not reached is asked (`doit info`, `doit list
    --status`)."""

    def __init__(self, bake: Bake, module, done: Outcome, checks: dict[str, _UpToDate], deps: dict):
        self.bake, self.module, self.done, self.checks, self.reason = bake, module, done, checks, None
        self.deps = deps

    def __call__(self) -> bool:
        try:
            status = check(self.bake, self.module)
        except Exception as e:  # a base that cannot be read: the step's action meets it again, told as one line
            self.reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            return False
        self.reason = status.reason
        if not status.up_to_date:
            return False
        reached = set(self.done.ran) | set(self.done.skipped)
        before = [d for d in self.deps[self.module.NAME] if d not in reached and not self.checks[d]()]
        if before:
            self.reason = f"after {', '.join(before)}"
            return False
        return True

    def __repr__(self) -> str:
        return f"stamp of {self.module.NAME}: {self.reason or 'not checked yet'}"


def remove_stamp(bake: Bake, module, dryrun: bool = False) -> None:
    """``doit clean``: remove a step's stamp (so that it runs again) and keep its outputs,
    saying both; a checkpoint is never deleted by cleaning."""
    stamp = bake.folder.stamp(module.NAME)
    kept = ", ".join(t for t in module.TARGETS if t.startswith("(") or (bake.folder.root / t).exists())
    verb = "would remove" if dryrun else "removed"
    if not stamp.exists():
        print(f"{GROUP}:{module.NAME} - no stamp to remove; outputs untouched")
        return
    if not dryrun:
        stamp.unlink()
    print(f"{GROUP}:{module.NAME} - {verb} its stamp '{stamp}'; kept its outputs: {kept or '(none yet)'}")


def doit_tasks(bake: Bake, done: Outcome):
    """The doit task dictionaries of a bake, in order; what they do is recorded in `done`."""
    folder = bake.folder
    steps, deps = graph_of(bake)
    checks: dict[str, _UpToDate] = {}
    for module in steps:
        checks[module.NAME] = _UpToDate(bake, module, done, checks, deps)
    for module in steps:
        yield {
            "basename": GROUP,
            "name": module.NAME,
            "doc": (module.__doc__ or "").strip().splitlines()[0],
            "actions": [(action, [bake, done, module])],
            "file_dep": [str(folder.stamp(d)) for d in deps[module.NAME]],
            "targets": [str(folder.stamp(module.NAME))],
            "uptodate": [checks[module.NAME]],
            # `doit clean` removes the stamps only: outputs stay (checkpoints are expensive)
            "clean": [(remove_stamp, [bake, module])],
            "verbosity": 2,
        }


def action(bake: Bake, done: Outcome, module: ModuleType):
    """A step as a doit action: its error is kept on `done`, to be told as one line by the
    caller, and doit is only told that the task failed."""
    from doit.exceptions import TaskFailed

    from ..errors import RunStopped

    try:
        if bake.folder.stop_request.exists():
            raise RunStopped(f"stopped before {module.NAME}, on request; bake again to go on")
        did = execute(bake, placed(bake, module))  # merge, bake: on the cluster when where.slurm.steps says
    except Exception as e:  # every error reaches the user through done.error
        done.error = e
        return TaskFailed(str(e).splitlines()[0] if str(e) else type(e).__name__)
    (done.ran if did else done.skipped).append(module.NAME)
    return True
