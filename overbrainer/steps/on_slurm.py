"""Merge and bake as Slurm jobs (``where.slurm.steps``): the step's work, its `run`, done by
a job of the cluster in the run folder on the shared filesystem, and its stamp written here
as every step's is (``steps.execute``), from the files the job made.

In the run folder's ``slurm/`` (besides what ``where/slurm.py`` writes for each job)::

    step-<step>.json      what the job does: the compiled bake (`Bake.handoff`), the step's
                          inputs and fingerprint
    outputs-<step>.json   what it made, as the job says it: {"fingerprint", "entries",
                          "root", "summary"}, or {"fingerprint", "error"}: one line

The job runs ``python -m overbrainer.steps.on_slurm RUN_DIR STEP``. A job that ended well
while nothing here followed it is taken up from its outputs file (which this side takes away
once it has read it: a later bake never stamps what an old job said).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from ..errors import RunFailed
from ..folder import RunFolder
from ..portable.common import read_json, write_json
from ..stamps import fingerprint
from . import Outputs
from .train import tail

if TYPE_CHECKING:
    from .context import Bake

__all__ = ["placed", "Sent", "main"]

SENDABLE = ("merge", "bake")


def placed(bake: Bake, module):
    """The step as the plan places it: `Sent` when where.slurm.steps sends it to the
    cluster, else the step itself."""
    where = bake.plan.model_dump(mode="json").get("where")
    steps = where.get("slurm", {}).get("steps", ()) if isinstance(where, dict) else ()
    return Sent(module) if _kind(module) in SENDABLE and _kind(module) in steps else module


def _kind(module) -> str:
    return getattr(module, "kind", module.NAME)  # a branch's step: "merge" for merge@b


class Sent:
    """A step (merge, bake, or a branch's) whose work a Slurm job does: its own name,
    version and inputs (the same stamp as here), its `run` on the cluster."""

    def __init__(self, module):
        self.module = module
        self.NAME, self.VERSION, self.TARGETS = module.NAME, module.VERSION, module.TARGETS
        self.__doc__ = module.__doc__

    def inputs(self, bake: Bake) -> dict:
        return self.module.inputs(bake)

    def run(self, bake: Bake, inputs: dict) -> Outputs:
        from ..where import target_for
        from ..where.bundle import Base
        from . import upstream

        name, folder = self.NAME, bake.folder
        fp = fingerprint(name, self.VERSION, inputs)
        outputs = folder.slurm / f"outputs-{name}.json"
        said = read_json(outputs) or {}
        if said.get("fingerprint") == fp and "entries" in said:
            bake.say(f"{name}: its Slurm job had ended well while nothing here followed it: taking it up")
        else:
            outputs.unlink(missing_ok=True)
            folder.slurm.mkdir(exist_ok=True)
            write_json(folder.slurm / f"step-{name}.json",
                       {"step": name, "fingerprint": fp, "inputs": inputs, "bake": bake.handoff()})
            target = target_for(bake.plan.where, Base.from_stamp(upstream(bake, "base")), bake.hashes, bake.plan_dir,
                                say=bake.say, shown=bake.shown, tell=bake.tell)
            try:
                job, code = target.run_step(name, ["python", "-m", __name__, str(folder.root), name], folder.root,
                                            fp, folder.log)
            except RunFailed as e:  # the job's own line, when its step's work raised, goes first
                said = read_json(outputs) or {}
                if said.get("fingerprint") == fp and said.get("error"):
                    raise RunFailed(f"{name} failed on the cluster: {said['error']}; {e}", log_tail=e.log_tail) from None
                raise
            said = read_json(outputs) or {}
            if said.get("fingerprint") != fp or "entries" not in said:
                why = said.get("error") or f"it ended with exit code {code} without saying what it made"
                raise RunFailed(f"{name} failed in the Slurm job {job}: {why}; the end of {bake.shown(folder.log)}:",
                                log_tail=tail(folder.log, 15))
        outputs.unlink()
        return Outputs(said["entries"], said["root"], said["summary"])


def _step(name: str) -> ModuleType:
    """A step sendable to the cluster, by its name in the graph (merge, bake, merge@b...)."""
    from . import bake as bake_step
    from . import branch, merge

    kind, _, label = name.partition("@")
    if label:
        return {s.kind: s for s in branch.steps_of(label)}[kind]
    return {"merge": merge, "bake": bake_step}[kind]


def main(run_dir: Path, name: str) -> int:
    """The job's side: the step's work on the bake this side compiled, what it made (or
    why it could not, in one line) into slurm/outputs-<step>.json."""
    from .context import Bake

    folder = RunFolder(run_dir)
    sent = read_json(folder.slurm / f"step-{name}.json")
    outputs = folder.slurm / f"outputs-{name}.json"
    try:
        bake = Bake.from_handoff(sent["bake"], say=lambda line: print(line, flush=True))
        bake.validate()
        out = _step(name).run(bake, sent["inputs"])
    except Exception as e:  # told here in one line; the traceback stays in the job's log
        import traceback

        traceback.print_exc()
        write_json(outputs, {"fingerprint": sent["fingerprint"], "error": str(e).splitlines()[0] if str(e) else
                             type(e).__name__})
        return 1
    write_json(outputs, {"fingerprint": sent["fingerprint"], "entries": out.entries, "root": out.root,
                         "summary": out.summary})
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: python -m overbrainer.steps.on_slurm RUN_DIR STEP (what a Slurm job of where.slurm.steps runs)",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
