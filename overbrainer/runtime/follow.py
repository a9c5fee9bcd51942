"""Following a run from another process: a progress bar on a terminal, lines elsewhere.

Following reads run.json and metrics.jsonl; it never touches the run. Ctrl-C stops the
following, not the run.
"""

from __future__ import annotations

import sys
import time
from typing import Protocol

__all__ = ["follow", "describe"]


class Followed(Protocol):
    """What following needs of a run (`run.Run` has it)."""

    def progress(self) -> dict: ...


def describe(p: dict) -> str:
    """One line of progress: step of steps, losses, pace, time left."""
    parts = [p["state"]]
    if p.get("steps"):
        parts.append(f"step {p['step']}/{p['steps']}")
    if p.get("loss") is not None:
        parts.append(f"loss {p['loss']:.4f}")
    if p.get("eval_loss") is not None:
        parts.append(f"eval {p['eval_loss']:.4f}")
    if p.get("tokens_per_second"):
        parts.append(f"{p['tokens_per_second']:.0f} tok/s")
    if p.get("eta") and p["state"] in ("running", "stopping"):
        parts.append(f"eta {_duration(p['eta'])}")
    return "  ".join(parts)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def follow(run: Followed, poll: float = 0.5, show: bool = True, out=None) -> str:
    """Follow `run` until it is no longer active; return its final state.

    Each step of the graph gets a line when it starts (``split: not done yet``), on a
    terminal and in a pipe alike; training then gets a bar on a terminal (its total from
    this attempt's step count) and a line per step elsewhere. Nothing is shown of an
    earlier attempt: steps only once this attempt's training is under way."""
    from ..journal import ACTIVE

    out = out or sys.stderr
    shown = _Shown(out, show)
    try:
        while True:
            p = run.progress()
            state, stages = p["state"], p["stages"]
            if shown.step == -1 and state not in ACTIVE:
                shown.stages = len(stages)  # an attempt that has ended: not told again
            for name, why in stages[shown.stages:]:
                if shown.training:  # training is over: its last step, then the next stage
                    shown.steps(p)
                    shown.end_training()
                shown.say(f"{name}: {why}")
                shown.training = name == "train"
            shown.stages = len(stages)
            if shown.training and p["step"] > 0 and p.get("steps"):
                shown.steps(p)
            shown.step = max(shown.step, 0)
            if state not in ACTIVE and state != "planned":
                return state
            time.sleep(poll)
    finally:
        shown.end_training()


class _Shown:
    """What `follow` has shown so far, and how: a bar on a terminal, lines elsewhere."""

    def __init__(self, out, show: bool):
        self.out, self.show = out, show
        self.step, self.stages, self.training, self.bar = -1, 0, False, None

    def say(self, line: str) -> None:
        if self.show:
            print(line, file=self.out, flush=True)

    def steps(self, p: dict) -> None:
        if not self.show or p["step"] <= 0:
            return
        if self.out.isatty():
            self.bar = self.bar or _bar(p["steps"], self.out)
            self.bar.total = p["steps"]  # this attempt's, whatever the bar began with
            self.bar.n = p["step"]
            self.bar.set_description_str(p["state"])
            self.bar.set_postfix_str(describe({**p, "state": ""}).replace(f"step {p['step']}/{p['steps']}", "").strip())
            self.bar.refresh()
        elif p["step"] != self.step:
            print(describe(p), file=self.out, flush=True)
        self.step = p["step"]

    def end_training(self) -> None:
        self.training = False
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _bar(total: int, out):
    from tqdm import tqdm

    return tqdm(total=total, file=out, unit="step", dynamic_ncols=True, leave=True)
