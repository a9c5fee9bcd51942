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
    """Follow `run` until it is no longer active; return its final state."""
    from ..journal import ACTIVE

    out = out or sys.stderr
    bar = None
    shown_step = -1
    try:
        while True:
            p = run.progress()
            state = p["state"]
            if show and p.get("steps"):
                if out.isatty():
                    bar = bar or _bar(p["steps"], out)
                    bar.n = p["step"]
                    bar.set_description_str(state)
                    bar.set_postfix_str(describe({**p, "state": ""}).replace(f"step {p['step']}/{p['steps']}", "").strip())
                    bar.refresh()
                elif p["step"] != shown_step:
                    print(describe(p), file=out, flush=True)
            shown_step = p["step"]
            if state not in ACTIVE and state != "planned":
                return state
            time.sleep(poll)
    finally:
        if bar is not None:
            bar.close()


def _bar(total: int, out):
    from tqdm import tqdm

    return tqdm(total=total, file=out, unit="step", dynamic_ncols=True, leave=True)
