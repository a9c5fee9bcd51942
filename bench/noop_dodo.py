"""The bake's steps as a plain doit dodo.py, for `noop_rerun.py` to compare with.

    doit -f bench/noop_dodo.py -d RUN_DIR base=BASE_DIR plan=PLAN_FILE data=DATA_FILE

The way a doit user writes it: each step a task whose ``file_dep`` are the files it reads
and whose ``targets`` are the files it writes (doit takes files, not folders, so folders
are listed file by file), with doit's default checker (md5 of a file_dep whose mtime
changed) and its default backend. Paths inside the run folder are relative to it (``-d``),
so that a copied run folder is the same to doit.

No action is meant to run: `noop_rerun.py` records doit's state with ``doit reset-dep``
over finished outputs, and an action that runs fails, naming its step.
"""

import os
from pathlib import Path

from doit import get_var

BASE = Path(get_var("base", "base"))
PLAN = get_var("plan", "plan.json")
DATA = get_var("data", "chats.jsonl")

DOIT_CONFIG = {"dep_file": ".plain-doit.db", "verbosity": 0}


def files(folder: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(folder):
        out.extend(os.path.join(dirpath, n) for n in names if not n.startswith("."))
    return sorted(out)


def base_files() -> list[str]:
    return [str(p) for p in files(str(BASE))]


def would_run(step):
    def action():
        print(f"plain doit would rerun {step}")
        return False

    return action


def last_checkpoint() -> str:
    steps = sorted(p for p in os.listdir("checkpoints") if p.startswith("step-"))
    return os.path.join("checkpoints", steps[-1])


def task_resolve():
    return {"actions": [would_run("resolve")], "file_dep": [PLAN, DATA, *base_files()], "targets": ["plan.json"]}


def task_base():
    return {"actions": [would_run("base")], "file_dep": [PLAN], "targets": base_files()}


def task_split():
    return {"actions": [would_run("split")], "file_dep": [PLAN, DATA], "targets": ["examples.parquet"]}


def task_config():
    return {
        "actions": [would_run("config")],
        "file_dep": [PLAN, "examples.parquet", *base_files()],
        "targets": ["config.yaml"],
    }


def task_train():
    return {
        "actions": [would_run("train")],
        "file_dep": ["config.yaml", "examples.parquet", *base_files()],
        "targets": [*files("checkpoints"), "metrics.jsonl"],
    }


def task_merge():
    return {
        "actions": [would_run("merge")],
        "file_dep": ["config.yaml", *files(last_checkpoint()), *base_files()],
        "targets": files("merged"),
    }


def task_bake():
    return {"actions": [would_run("bake")], "file_dep": files("merged"), "targets": files("baked")}
