"""The graph as documentation, and why a step would run.

`survey` tells, for each step in graph order, its status, read from the stamps (never an
output's content: a file is hashed only when its mtime changed, and the hash cache keeps
the answer)::

    done     its stamp has the current fingerprint, its outputs match, nothing before it reruns
    stale    it has a stamp but would run: its inputs or outputs changed, or a step before it reruns
    running  the run is under way (run.json) and this is the step in progress
    missing  no stamp: it never ran, was cleaned, or was interrupted

`recorded` tells the same from the run folder alone (its stamps and run.json, no plan, no
dry run: what ``serve`` shows of any run folder), where a stamp is taken as done and the
step the run ended on is ``failed`` or ``stopped``.

`render` draws the graph as text, Mermaid (GitHub renders it) or Graphviz dot: the steps
with the files they write, or (``outs``) the files alone, an edge from every file of a step
to every file of the steps after it, like ``dvc dag --outs``. `why` says, for each step
that would run, what changed (a plan field, a file's hash, an output, the step's code) and
what it makes rerun after it.

Nothing here imports torch or transformers, runs a step or writes anything but the hash
cache.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from ..errors import OverbrainerError
from ..stamps import input_changes, read_stamp, short
from .tasks import downstream, graph_of

if TYPE_CHECKING:
    from ..folder import RunFolder
    from ..steps.context import Bake

__all__ = ["StepState", "STATUSES", "FORMATS", "steps", "survey", "recorded", "why", "why_text", "render", "as_json"]

STATUSES = ("done", "stale", "running", "missing", "failed", "stopped")
FORMATS = ("text", "mermaid", "dot")

# fill and stroke of each status, in Mermaid and dot alike
_COLOURS = {
    "done": ("#d3f9d8", "#2b8a3e"),
    "stale": ("#fff3bf", "#e67700"),
    "running": ("#d0ebff", "#1c7ed6"),
    "missing": ("#f1f3f5", "#868e96"),
    "failed": ("#ffe3e3", "#c92a2a"),
    "stopped": ("#f3d9fa", "#862e9c"),
}
_ANSI = {"done": "32", "stale": "33", "running": "34", "missing": "90", "failed": "31", "stopped": "35"}


@dataclass
class StepState:
    step: str
    targets: list[str]  # the files it writes (its module's TARGETS)
    after: list[str]  # the steps whose outputs it reads (graph.DEPS)
    status: str | None = None  # one of STATUSES; None when not asked (a neutral graph)
    why: str = ""  # one line, as ``bake --dry-run`` says it
    changes: list[dict] = field(default_factory=list)  # what changed, for `why`
    reruns: list[str] = field(default_factory=list)  # the steps after it that it makes rerun


def steps(bake: Bake | None = None) -> list[StepState]:
    """The graph alone, without statuses: the same on every machine (the README's copy);
    with `bake`, that bake's (its budgets' and its decays' branches)."""
    graph, deps = graph_of(bake)
    return [StepState(m.NAME, list(m.TARGETS), list(deps[m.NAME])) for m in graph]


def survey(bake: Bake) -> list[StepState]:
    """Each step with its status and why, from the stamps and run.json."""
    from .driver import dry_run

    rows = {row["step"]: row for row in dry_run(bake)}
    current = _in_progress(bake.folder, bake)
    out = []
    for state in steps(bake):
        row = rows[state.step]
        has_stamp = read_stamp(bake.folder.stamp(state.step)) is not None
        if state.step == current:
            state.status, state.why = "running", "running now"
        elif not has_stamp:
            state.status, state.why = "missing", "not done yet"
        elif row["run"]:
            state.status, state.why = "stale", row["why"]
        else:
            state.status, state.why = "done", "up to date"
        out.append(state)
    return out


def recorded(folder: RunFolder) -> list[StepState]:
    """Each step's status as the run folder records it: done (a stamp), running (the live
    bake's step), failed or stopped (the step the last bake ended on), else missing."""
    from .. import journal

    current = _in_progress(folder)
    status = journal.status(folder) if folder.run_json.exists() else {}
    state = status.get("state")
    ended = _first_unstamped(folder, status.get("task")) if state in ("failed", "stopped") else None
    out = []
    for s in steps():
        if s.step == current:
            s.status, s.why = "running", "running now"
        elif s.step == ended:
            s.status, s.why = state, f"{state} here"
        elif read_stamp(folder.stamp(s.step)) is not None:
            s.status, s.why = "done", "done"
        else:
            s.status, s.why = "missing", "not done yet"
        out.append(s)
    return out


def _in_progress(folder: RunFolder, bake: Bake | None = None) -> str | None:
    """The step a live bake of this folder is doing now, if one is under way."""
    if not folder.run_json.exists():
        return None
    from .. import journal

    try:
        status = journal.status(folder)  # a process that died is not shown as running
    except journal.Damaged:
        return None  # shown by the stamps alone; `overbrainer status` says what is wrong
    if status.get("state") not in journal.ACTIVE:
        return None
    return _first_unstamped(folder, status.get("task"), bake)


def _first_unstamped(folder: RunFolder, task: str | None, bake: Bake | None = None) -> str | None:
    graph, deps = graph_of(bake)  # without a bake (the serve page's record): the single-budget graph
    if task in deps:
        return task
    # a run.json from before it named its step: steps run in order, each deleting its
    # stamp when it starts, so the first one without a stamp is the one under way
    for module in graph:
        if read_stamp(folder.stamp(module.NAME)) is None:
            return module.NAME
    return None


# -- why ---------------------------------------------------------------------------------


def why(bake: Bake, step: str | None = None) -> list[StepState]:
    """Every step (or `step`, with the stale steps before it that make it rerun), with what
    changed and what it makes rerun."""
    deps = graph_of(bake)[1]
    if step is not None and step not in deps:
        names = ", ".join(deps)
        raise OverbrainerError(f"why: no step {step!r}; the steps are {names}")
    states = survey(bake)
    by_name = {s.step: s for s in states}
    for state in states:
        if state.status != "stale":
            continue
        if state.why.startswith("after "):
            state.changes = [{"kind": "upstream", "step": s} for s in state.why[6:].split("; ")[0].split(", ")]
            continue
        state.changes = _changes(bake, state.step)
        state.reruns = downstream(state.step, bake)
    if step is None:
        return states
    if by_name[step].status in ("done", "running"):
        return [by_name[step]]
    # the steps before it that make it run: those that never ran, or whose own inputs,
    # outputs or code changed (not those that only follow another)
    before = _before(step, deps)
    return [s for s in states if s.step == step or (s.step in before and _is_cause(s))]


def _is_cause(s: StepState) -> bool:
    return s.status in ("missing", "running") or (s.status == "stale" and not s.why.startswith("after "))


def _before(name: str, deps: dict) -> set[str]:
    """Every step whose outputs `name` reads, directly or not."""
    out: set[str] = set()
    todo = list(deps[name])
    while todo:
        d = todo.pop()
        if d not in out:
            out.add(d)
            todo.extend(deps[d])
    return out


def _changes(bake: Bake, name: str) -> list[dict]:
    """What differs between a step's stamp and now: its code, its inputs, its outputs."""
    from ..steps import NotReady
    from .tasks import step as step_module

    module = step_module(name, bake)
    stamp = read_stamp(bake.folder.stamp(name))
    if stamp is None:
        return []
    if stamp.version != module.VERSION:
        return [{"kind": "code", "field": "version", "old": stamp.version, "new": module.VERSION}]
    try:
        inputs = module.inputs(bake)
    except NotReady as e:
        return [{"kind": "upstream", "step": e.step, "missing": True}]
    changes = []
    for key, old, new in input_changes(stamp.inputs, inputs):
        file = re.fullmatch(r".*\[(.+)\]\.hash", key)
        if file:
            changes.append({"kind": "file", "field": key, "path": file.group(1), "old": old, "new": new})
        else:
            changes.append({"kind": "input", "field": key, "old": old, "new": new})
    if changes:
        return changes
    return _output_changes(bake, stamp)


def _output_changes(bake: Bake, stamp) -> list[dict]:
    """The outputs that no longer match the stamp's manifest, with old and new hash
    (the same test as `stamps.verify`: a matching size and mtime is trusted)."""
    root = bake.folder.root / stamp.root
    out = []
    for entry in stamp.outputs:
        path = root / entry["path"]
        try:
            st = path.stat()
        except OSError:
            out.append({"kind": "output", "path": entry["path"], "old": entry["hash"], "new": None})
            continue
        if st.st_size == entry["size"] and st.st_mtime_ns == entry["mtime_ns"]:
            continue
        new = bake.hashes.hash(path, st)
        if new != entry["hash"]:
            out.append({"kind": "output", "path": entry["path"], "old": entry["hash"], "new": new})
    if bake.folder.root.is_dir():
        bake.hashes.save()
    return out


def why_text(states: list[StepState]) -> str:
    """`why` in words: a line per step, the changes and what reruns under a stale one."""
    lines = []
    for s in states:
        if s.status == "stale" and s.why.startswith("after "):
            lines.append(f"{s.step}: stale, reruns {s.why}")
            continue
        if s.status != "stale":
            lines.append(f"{s.step}: {s.why}")
            continue
        lines.append(f"{s.step}: stale")
        lines.extend(f"  {_change_line(c)}" for c in s.changes or [{"kind": "other", "why": s.why}])
        if s.changes and "; resumes from " in s.why:  # what of its outputs it goes on from
            lines.append(f"  {s.why.split('; ', 1)[1]}")
        lines.append(f"  makes rerun: {', '.join(s.reruns)}" if s.reruns else "  makes nothing else rerun")
    return "\n".join(lines) + "\n"


def _change_line(c: dict) -> str:
    kind = c["kind"]
    if kind == "file":
        return f"file {c['path']}: {short(c['old'])} → {short(c['new'])}"
    if kind == "output":
        if c["new"] is None:
            return f"output {c['path']} is missing (was {short(c['old'])})"
        return f"output {c['path']}: {short(c['old'])} → {short(c['new'])}"
    if kind == "code":
        return f"its code changed (version {c['old']} → {c['new']})"
    if kind == "upstream":
        return f"waits for {c['step']}"
    if kind == "input":
        return f"{c['field']}: {short(c['old'])} → {short(c['new'])}"
    return c.get("why", "")


# -- drawing -----------------------------------------------------------------------------


PLAN = "plan"  # the plan file's node (no step or file is called so); shown by its file name


def _edges(states: list[StepState]) -> list[tuple[str, str]]:
    """Step view: the plan before the steps that read nothing else, then graph.DEPS."""
    edges = [(PLAN, s.step) for s in states if not s.after]
    edges += [(d, s.step) for s in states for d in s.after]
    return edges


def _file_edges(states: list[StepState]) -> list[tuple[str, str]]:
    """File view: every file of a step before every file of the steps after it."""
    by_name = {s.step: s for s in states}
    edges = []
    for s in states:
        sources = [[PLAN]] if not s.after else [by_name[d].targets for d in s.after]
        edges += [(u, t) for group in sources for u in group for t in s.targets]
    return edges


def as_json(bake: Bake, states: list[StepState], outs: bool = False) -> dict:
    report = {"plan": bake.plan.name, "plan_file": str(bake.plan_path), "folder": str(bake.folder.root)}
    if outs:
        files = [{"path": t, "step": s.step, "status": s.status} for s in states for t in s.targets]
        return {**report, "files": files, "edges": _file_edges(states)}
    rows = [{k: v for k, v in asdict(s).items() if k not in ("changes", "reruns")} for s in states]
    return {**report, "steps": rows, "edges": _edges(states)}


def render(states: list[StepState], fmt: str = "text", outs: bool = False, plan: str = "plan.json",
           color: bool = False) -> str:
    """The graph as `fmt` (text, mermaid or dot); ``plan`` names the plan file's node."""
    if fmt not in FORMATS:
        raise OverbrainerError(f"graph: no format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "text":
        return _text(states, outs, plan, color)
    if outs:
        nodes = [(t, t, s.status) for s in states for t in s.targets]
        edges = _file_edges(states)
    else:
        nodes = [(s.step, s.step + "".join(f"\n{t}" for t in s.targets), s.status) for s in states]
        edges = _edges(states)
    return (_mermaid if fmt == "mermaid" else _dot)(nodes, edges, plan)


def _node_id(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", key).strip("_") or "node"


def _mermaid(nodes, edges, plan: str) -> str:
    ids = {PLAN: "plan", **{key: _node_id(key) for key, _, _ in nodes}}
    lines = ["flowchart LR", f'    plan[/"{plan}"/]']
    for key, label, _ in nodes:
        lines.append(f'    {ids[key]}["{label.replace(chr(10), "<br/>")}"]')
    lines += [f"    {ids[a]} --> {ids[b]}" for a, b in edges]
    used = [st for st in STATUSES if any(status == st for _, _, status in nodes)]
    for st in used:
        fill, stroke = _COLOURS[st]
        dash = ",stroke-dasharray:4 4" if st == "missing" else ""
        lines.append(f"    classDef {st} fill:{fill},stroke:{stroke}{dash}")
        lines.append(f"    class {','.join(ids[k] for k, _, status in nodes if status == st)} {st}")
    return "\n".join(lines) + "\n"


def _dot(nodes, edges, plan: str) -> str:
    lines = [
        "digraph overbrainer {",
        "    rankdir=LR;",
        '    node [shape=box, style="rounded,filled", fillcolor="#ffffff", fontname="Helvetica"];',
        f"    {json.dumps(PLAN)} [label={json.dumps(plan)}, shape=note];",
    ]
    for key, label, status in nodes:
        attrs = [f"label={json.dumps(label)}"]
        if status:
            fill, stroke = _COLOURS[status]
            attrs += [f'fillcolor="{fill}"', f'color="{stroke}"', f'tooltip="{status}"']
            if status == "missing":
                attrs.append('style="rounded,filled,dashed"')
        lines.append(f"    {json.dumps(key)} [{', '.join(attrs)}];")
    lines += [f"    {json.dumps(a)} -> {json.dumps(b)};" for a, b in edges]
    return "\n".join(lines + ["}"]) + "\n"


def _text(states: list[StepState], outs: bool, plan: str, color: bool) -> str:
    with_status = any(s.status for s in states)

    def paint(status: str | None, width: int) -> str:
        word = (status or "").ljust(width)
        return f"\033[{_ANSI[status]}m{word}\033[0m" if color and status else word

    if outs:
        order = [PLAN] + [t for s in states for t in s.targets]
        edges = _file_edges(states)
        sources = {t: sorted({u for u, v in edges if v == t}, key=order.index) for s in states for t in s.targets}
        head = ["file", "step"] + (["status"] if with_status else []) + ["from"]
        rows = [[t, s.step] + ([s.status] if with_status else []) + [", ".join(plan if u == PLAN else u for u in sources[t])]
                for s in states for t in s.targets]
    else:
        head = ["step"] + (["status"] if with_status else []) + ["after", "writes"]
        rows = [[s.step] + ([s.status] if with_status else []) + [", ".join(s.after) or plan, "  ".join(s.targets)]
                for s in states]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    status_col = head.index("status") if with_status else -1
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    for r in rows:
        cells = [paint(v, w) if i == status_col else str(v).ljust(w) for i, (v, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines) + "\n"
