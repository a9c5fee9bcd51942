"""doit's entry: ``doit train plan=plans/x.json`` runs the same graph as ``overbrainer bake``.

``doit list --all plan=...`` shows the steps (``train:split``, ``train:config``, ...);
``doit info train:train plan=...`` tells why one would run.

The stamps are the source of truth: ``doit clean train:bake plan=...`` removes that step's
stamp (so it runs again) and never its outputs; ``doit forget`` clears doit's own memory
only, so the next ``doit train`` finds every stamp up to date and runs nothing.
"""

import sys

from doit import get_var

from overbrainer.errors import OverbrainerError

PLAN = get_var("plan", None)
BAKE = None
DONE = None
DOIT_CONFIG = {"default_tasks": ["train"], "verbosity": 2}

if PLAN:
    from overbrainer.graph.driver import Outcome, compile_bake, doit_config

    try:
        BAKE = compile_bake(PLAN, say=lambda message: print(message, flush=True))
    except OverbrainerError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    BAKE.folder.root.mkdir(parents=True, exist_ok=True)
    DONE = Outcome()
    DOIT_CONFIG = doit_config(BAKE, DONE, tell_errors=True)


def task_train():
    """bake a plan: doit train plan=plans/x.json"""
    if BAKE is None:
        yield {
            "name": None,
            "actions": [lambda: print("give the plan: doit train plan=plans/demo.json") and False],
        }
        return
    from overbrainer.graph.tasks import doit_tasks

    yield from doit_tasks(BAKE, DONE)
