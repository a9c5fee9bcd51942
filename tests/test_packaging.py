"""What a user installs: the license the metadata declares, type information, the
changelog, and `scripts/setup`, which reinstalls only when what it installs from changed."""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_wheel_has_license_types_and_classifiers(tmp_path):
    pytest.importorskip("setuptools")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("overbrainer-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "overbrainer/py.typed" in names
    # the CPU kernels' sources, which an installed package builds on first use
    for kernel in ("cpu_attention_forward.cpp", "cpu_attention_backward.cpp", "cpu_token_loss.cpp", "cpu_kernels.h"):
        assert f"overbrainer/trainers/builtin/{kernel}" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names), names
    meta = email.message_from_bytes(zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA"))))
    classifiers = meta.get_all("Classifier")
    assert "License :: OSI Approved :: Apache Software License" in classifiers and "Typing :: Typed" in classifiers
    assert "Apache-2.0" in (meta.get("License") or meta.get("License-Expression") or "")
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole text, not a pointer to it


def test_changelog_names_this_version():
    from overbrainer import __version__

    log = (REPO / "CHANGELOG.md").read_text()
    assert f"## [{__version__}]" in log and "## [Unreleased]" in log


def fake_venv(root: Path) -> Path:
    """A .venv whose python records what it is asked to run: `scripts/setup`'s decisions are
    the subject here, not pip's downloads (which need the network). `pip install -e` makes
    the console script, as the real one does."""
    bin_ = root / ".venv" / "bin"
    bin_.mkdir(parents=True)
    python = bin_ / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> "{root}/calls.log"\n'
        'case "$*" in *"install -e"*) touch "$(dirname "$0")/overbrainer"; chmod +x "$(dirname "$0")/overbrainer";; esac\n'
    )
    python.chmod(0o755)
    return root / "calls.log"


def test_setup_installs_again_only_when_pyproject_or_torch_changed(tmp_path):
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup", root / "scripts" / "setup")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    calls = fake_venv(root)
    env = {**os.environ, "OVERBRAINER_TORCH": "2.13.0"}

    def setup(*args: str, **extra) -> tuple[list[str], float]:
        before = calls.read_text().splitlines() if calls.exists() else []
        started = time.monotonic()
        subprocess.run(["bash", "scripts/setup", *args], cwd=root, env={**env, **extra}, check=True, capture_output=True)
        after = calls.read_text().splitlines() if calls.exists() else []
        return [c for c in after[len(before):] if "install -e" in c], time.monotonic() - started

    assert len(setup()[0]) == 1  # the first time: installed
    again, seconds = setup()
    assert again == [] and seconds < 2.0  # the same pyproject and torch: nothing to do
    with open(root / "pyproject.toml", "a") as f:
        f.write("\n# a new dependency, say\n")
    assert len(setup()[0]) == 1
    assert setup()[0] == []
    assert len(setup(OVERBRAINER_TORCH="2.12.0")[0]) == 1  # another torch: installed again
    (root / ".venv" / "bin" / "overbrainer").unlink()  # an environment that lost the package
    assert len(setup(OVERBRAINER_TORCH="2.12.0")[0]) == 1
    # the test suite's extras (scripts/test): installed once; then the demo's plain setup
    # has what it needs, and asks for nothing
    dev = setup("dev", OVERBRAINER_TORCH="2.12.0")[0]
    assert len(dev) == 1 and dev[0].endswith("install -e .[dev]"), dev
    assert setup("dev", OVERBRAINER_TORCH="2.12.0")[0] == []
    assert setup(OVERBRAINER_TORCH="2.12.0")[0] == []
