"""No false success, no clobbering: a damaged doit database, two plans that want one run
folder, and an archive that ``overbrainer import`` must bound before it writes anything."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import bake_json, cli


def test_a_damaged_doit_database_never_reports_done_over_a_missing_target(baked_copy, tmp_path):
    project = baked_copy()
    folder = tmp_path / "runs" / "tiny"
    reference = (folder / "baked" / "model.safetensors").read_bytes()
    (folder / ".doit.db").write_bytes(os.urandom(5000))
    shutil.rmtree(folder / "baked")
    proc = cli("bake", str(project.plan_path), "--foreground", "--json", check=0)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "Traceback" not in proc.stderr + proc.stdout
    assert report["state"] == "done" and "bake" in report["ran"], report
    assert (folder / "baked" / "model.safetensors").read_bytes() == reference
    warnings = [line for line in proc.stderr.splitlines() if ".doit.db" in line]
    assert len(warnings) == 1 and "rebuilt from the stamps" in warnings[0], proc.stderr
    run = json.loads((folder / "run.json").read_text())
    assert run["attempts"][-1]["exit"] == 0 and run["state"] == "done"


def test_two_plan_files_with_one_name_never_share_a_run_folder(baked_copy, tmp_path):
    project = baked_copy()
    folder = tmp_path / "runs" / "tiny"
    baked = (folder / "baked" / "model.safetensors").read_bytes()
    other = tmp_path / "other"
    shutil.copytree(project.root, other, symlinks=True)
    plan = json.loads((other / "plan.json").read_text())
    plan["train"]["learning_rate"] = 0.001
    (other / "plan.json").write_text(json.dumps(plan))
    stamps = {p.name: p.read_bytes() for p in (folder / ".stamps").iterdir()}

    for command in (("bake", "--foreground"), ("bake",), ("split",)):
        proc = cli(*command[:1], str(other / "plan.json"), *command[1:], check=2)
        (line,) = proc.stderr.strip().splitlines()
        assert "Traceback" not in line and str(project.plan_path.relative_to(tmp_path)) in line, line
        assert str((other / "plan.json").relative_to(tmp_path)) in line and "--force" in line, line
    assert {p.name: p.read_bytes() for p in (folder / ".stamps").iterdir()} == stamps
    assert (folder / "baked" / "model.safetensors").read_bytes() == baked

    # the same file, moved: the same plan
    moved = tmp_path / "moved"
    project.root.rename(moved)
    assert bake_json(str(moved / "plan.json"), "--foreground")["ran"] == []
    # the same file, edited: the same plan, validated again and rebaked
    (moved / "plan.json").write_text(json.dumps(plan))
    assert "config" in bake_json(str(moved / "plan.json"), "--check", check=1)["would_run"]
    # another file, taken over on purpose; from then on it owns the folder
    report = bake_json(str(other / "plan.json"), "--foreground", "--force")
    assert report["state"] == "done" and "train" in report["ran"]
    run = json.loads((folder / "run.json").read_text())
    assert run["plan_file"] == str((other / "plan.json").resolve())
    plan["train"]["learning_rate"] = 0.002
    (moved / "plan.json").write_text(json.dumps(plan))
    proc = cli("bake", str(moved / "plan.json"), "--foreground", check=2)
    assert "--force" in proc.stderr


def test_the_api_takes_a_folder_over_only_with_force(baked_copy, tmp_path):
    import overbrainer
    from overbrainer.errors import RunStateError

    project = baked_copy()
    folder = tmp_path / "runs" / "tiny"
    baked = (folder / "baked" / "model.safetensors").read_bytes()
    other = tmp_path / "other"
    shutil.copytree(project.root, other, symlinks=True)
    (other / "plan.json").write_text(json.dumps(project.plan, indent=3))  # the same settings, another file
    with pytest.raises(RunStateError, match=r"belongs to .*force=True"):
        overbrainer.bake(other / "plan.json", runs=tmp_path / "runs")
    model = overbrainer.bake(other / "plan.json", runs=tmp_path / "runs", force=True, wait=True, show=False)
    assert model.path == folder / "baked"
    assert json.loads((folder / "run.json").read_text())["plan_file"] == str((other / "plan.json").resolve())
    assert (folder / "baked" / "model.safetensors").read_bytes() == baked
    with pytest.raises(RunStateError, match="belongs to"):  # from then on the other file owns it
        overbrainer.bake(project.plan_path, runs=tmp_path / "runs")


@pytest.mark.parametrize("names", [("ü.json", "é.json"), ("a b.json", "a-b.json")])
def test_default_names_of_different_files_differ(tmp_path, names):
    from overbrainer.folder import default_name

    first, second = (default_name(tmp_path / n) for n in names)
    assert first != second and first.isascii() and second.isascii()
    assert default_name(tmp_path / "demo.json") == "demo"


# -- `overbrainer import`: bounded before anything is written --------------------------------

ARTIFACTS = {"entries": ["checkpoints", "metrics.jsonl", "log.txt"], "exclude": [], "required": "checkpoints"}


def result_archive(path: Path, files: dict[str, bytes], listed: dict[str, bytes] | None = None,
                   pad: int = 0) -> Path:
    """A job's result as `receive` reads it: result.json (listing `listed`, default
    `files`, padded with `pad` spaces), then the files."""
    import io
    import tarfile

    import blake3

    listed = files if listed is None else listed
    result = {"fingerprint": "fp", "end": {"exit": 0},
              "files": [{"path": n, "size": len(b), "hash": blake3.blake3(b).hexdigest()} for n, b in listed.items()]}
    with tarfile.open(path, "w") as tar:
        for name, data in {"result.json": json.dumps(result).encode() + b" " * pad, **files}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def refused(tmp_path: Path, archive: Path) -> str:
    from overbrainer.hashing import HashCache
    from overbrainer.where.receive import ImportRefused, receive

    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    with pytest.raises(ImportRefused) as e:
        receive(run, archive, ARTIFACTS, "fp", HashCache(run / ".hashes.json"))
    assert sorted(p.name for p in run.iterdir()) in ([], [".hashes.json"]), "nothing is written"
    assert "\n" not in str(e.value)
    return str(e.value)


def test_import_refuses_a_sparse_member_before_writing_it(tmp_path):
    import subprocess

    big = tmp_path / "src" / "checkpoints" / "step-000001" / "adapter_model.safetensors"
    big.parent.mkdir(parents=True)
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # 1 GiB of holes: a few hundred bytes as a GNU sparse member
    (tmp_path / "src" / "result.json").write_text(json.dumps(
        {"fingerprint": "fp", "end": {"exit": 0},
         "files": [{"path": "checkpoints/step-000001/adapter_model.safetensors", "size": 1 << 30, "hash": "0" * 64}]}))
    archive = tmp_path / "result.tar"
    subprocess.run(["tar", "--sparse", "-cf", str(archive), "-C", str(tmp_path / "src"), "result.json",
                    "checkpoints"], check=True)
    assert archive.stat().st_size < 100_000
    assert "is a sparse file" in refused(tmp_path, archive)


def test_import_caps_members_and_result_json_and_checks_entry_types(tmp_path):
    import time

    from overbrainer.where.receive import MAX_MEMBERS, MAX_RESULT_JSON

    many = {f"checkpoints/step-000001/f{i}": b"" for i in range(MAX_MEMBERS + 1)}
    started = time.monotonic()
    assert f"more than {MAX_MEMBERS:,} members" in refused(tmp_path, result_archive(tmp_path / "many.tar", many))
    assert time.monotonic() - started < 30  # linear: the quadratic name check took minutes

    fat = result_archive(tmp_path / "fat.tar", {"metrics.jsonl": b"{}\n"}, pad=MAX_RESULT_JSON)
    assert "result.json is" in refused(tmp_path, fat) and f"{MAX_RESULT_JSON:,}" in refused(tmp_path, fat)

    file_for_folder = result_archive(tmp_path / "type.tar", {"checkpoints": b"not a folder"})
    assert "'checkpoints' is a file where the job brings back a folder" in refused(tmp_path, file_for_folder)

    wrong_size = result_archive(tmp_path / "size.tar", {"metrics.jsonl": b"{}\n" * 10}, {"metrics.jsonl": b"{}\n"})
    assert "not with that size" in refused(tmp_path, wrong_size)
