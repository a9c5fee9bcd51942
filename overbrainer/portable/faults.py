"""Fault points: where the reliability tests kill the process to prove nothing is lost.

``OVERBRAINER_FAULT=<point>[@<n>]`` makes the process SIGKILL itself the n-th time (1 by
default) it reaches `point`. Unset (always, outside tests) a point costs one dict lookup.
SQLite tests its crash safety the same way: the code says where a crash would hurt.

Points: ``split:before-rename``, ``stamp:before-replace``, ``runjson:before-replace``,
``checkpoint:between-files``, ``checkpoint:before-rename``, ``merge:before-rename``,
``bake:before-rename``, ``train:step`` (after each optimizer step, before its checkpoint).
"""

from __future__ import annotations

import os
import signal

_seen: dict[str, int] = {}


def point(name: str) -> None:
    wanted = os.environ.get("OVERBRAINER_FAULT")
    if not wanted:
        return
    target, _, nth = wanted.partition("@")
    if target != name:
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
