"""doit's entry: ``doit train plan=plans/x.json`` runs the same graph as ``overbrainer bake``.

``doit list --all plan=...`` shows the steps (``train:split``, ``train:config``, ...);
``doit info train:train plan=...`` tells why one would run (as ``overbrainer why`` does).
A ``doit train`` keeps run.json as ``overbrainer bake --foreground`` does (states, attempts,
the lock, a stop request cleared when it starts), so ``overbrainer status``, ``wait`` and
``stop`` work on it; without ``plan=`` it says how to give one and exits 2.

The stamps are the source of truth: ``doit clean train:bake plan=...`` removes that step's
stamp (so it runs again) and never its outputs; ``doit forget`` clears doit's own memory
only, so the next ``doit train`` finds every stamp up to date and runs nothing.
"""

import sys

from doit import get_var

from overbrainer.errors import OverbrainerError

PLAN = get_var("plan", None)
if not PLAN:
    print("error: give the plan: doit train plan=plans/demo.json (doit list --all plan=plans/demo.json "
          "lists its steps)", file=sys.stderr)
    sys.exit(2)

from overbrainer.graph.doitdb import set_aside_damaged_db  # noqa: E402
from overbrainer.graph.driver import Outcome, compile_bake, doit_config  # noqa: E402

try:
    BAKE = compile_bake(PLAN, say=lambda message: print(message, flush=True))
except OverbrainerError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(e.exit_code)
BAKE.take_over = get_var("force", "") not in ("", "0")  # force=1: take over another plan file's folder
BAKE.folder.root.mkdir(parents=True, exist_ok=True)
set_aside_damaged_db(BAKE.folder)  # unreadable: rebuilt from the stamps
DONE = Outcome()
# run.json, the lock and the stop request kept as `overbrainer bake --foreground` keeps them
DOIT_CONFIG = doit_config(BAKE, DONE, tell_errors=True, record=True)


def task_train():
    """bake a plan: doit train plan=plans/x.json"""
    from overbrainer.graph.tasks import doit_tasks

    yield from doit_tasks(BAKE, DONE)
