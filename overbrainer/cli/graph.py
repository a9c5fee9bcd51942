"""The commands that show a plan's graph: ``graph`` and ``why``."""

from __future__ import annotations

import json
import sys

from .common import use_color


def add_parsers(sub) -> None:
    p = sub.add_parser("graph", help="the plan's graph: steps and the files they write, coloured by status")
    p.add_argument("plan", help="the plan file, e.g. plans/demo.json")
    p.add_argument("--format", choices=["text", "mermaid", "dot"], default="text")
    p.add_argument("--outs", action="store_true", help="the files alone, with an edge between files (like dvc dag --outs)")
    p.add_argument("--no-status", action="store_true", help="the graph alone, the same on every machine (no stamps read)")
    p.add_argument("--json", action="store_true", help="nodes, statuses and edges as one JSON object")
    p.set_defaults(func=cmd_graph)

    p = sub.add_parser("why", help="why each step would run: what changed, and what it makes rerun")
    p.add_argument("plan", help="the plan file, e.g. plans/demo.json")
    p.add_argument("step", nargs="?", help="one step (with the steps before it that make it run)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_why)


def cmd_graph(args) -> int:
    from ..graph import explain
    from ..graph.driver import compile_bake

    bake = compile_bake(args.plan, runs=args.runs)
    states = explain.steps(bake) if args.no_status else explain.survey(bake)
    if args.json:
        print(json.dumps(explain.as_json(bake, states, outs=args.outs), indent=1))
        return 0
    color = args.format == "text" and use_color(sys.stdout, args.no_color)
    sys.stdout.write(explain.render(states, args.format, outs=args.outs, plan=bake.plan_path.name, color=color))
    return 0


def cmd_why(args) -> int:
    from dataclasses import asdict

    from ..graph import explain
    from ..graph.driver import compile_bake

    bake = compile_bake(args.plan, runs=args.runs)
    states = explain.why(bake, args.step)
    if args.json:
        report = {"plan": bake.plan.name, "folder": str(bake.folder.root), "steps": [asdict(s) for s in states]}
        print(json.dumps(report, indent=1))
        return 0
    sys.stdout.write(explain.why_text(states))
    return 0
