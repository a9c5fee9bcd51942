"""What tests share: running the real command line in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO_DATA = REPO / "plans" / "data" / "pirate.jsonl"


def cli(*args: str, check: int | None = 0, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real command line in its own process."""
    proc = subprocess.run(
        [sys.executable, "-m", "overbrainer.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if check is not None and proc.returncode != check:
        raise AssertionError(
            f"exit {proc.returncode}, expected {check}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return proc


def bake_json(*args: str, check: int | None = 0, env: dict | None = None) -> dict:
    proc = cli("bake", *args, "--json", check=check, env=env)
    return json.loads(proc.stdout.strip().splitlines()[-1])
