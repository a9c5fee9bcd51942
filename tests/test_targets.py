"""Where it trains: an exported bundle run elsewhere (a real subprocess in another folder)
and brought back with `overbrainer import`, and a job over real OpenSSH to a real sshd on
127.0.0.1. Each ends with the same adapter weights and losses, bit for bit, as a bake here
(CPU); a stop there saves a checkpoint and a resume goes on from it; hostile results are
refused in one line with nothing written; no secret of the environment travels."""

from __future__ import annotations

import ast
import gzip
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from helpers import cli, cli_started, held, hold_at_step, release, stop_held

STEPS = 24  # long enough (about 8 s of training) for a stop to arrive in the middle
FINAL = f"checkpoints/step-{STEPS:06d}/adapter_model.safetensors"
SECRET = "hf_do_not_leak_5f0c9e1b"  # set as HF_TOKEN for the bakes and the jobs
LOOPBACK = "127.0.0.1"  # the only address these tests ever connect to


def bake(plan: Path, *args: str, check: int | None = 0, env: dict | None = None) -> dict:
    proc = cli("bake", str(plan), "--json", *args, check=check, env=env)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def weights(folder: Path) -> bytes:
    return (folder / FINAL).read_bytes()


def losses(folder: Path) -> list[tuple[int, float, float | None]]:
    records = map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
    return [(m["step"], m["loss"], m.get("eval_loss")) for m in records if "step" in m]


def metric_steps(path: Path) -> list[int]:
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for raw in text.splitlines():
        try:
            m = json.loads(raw)
        except ValueError:
            continue
        if "step" in m:
            out.append(m["step"])
    return out


def wait_for(what, timeout: float = 180, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def secret_free(root: Path) -> None:
    """No file under `root` holds the secret (gzip members read uncompressed)."""
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            data = p.read_bytes()
            if p.suffix == ".gz":
                data = gzip.decompress(data)
            assert SECRET.encode() not in data, p


_references: dict[str, Path] = {}


@pytest.fixture
def plan(project):
    project.write(steps=STEPS)
    return project


@pytest.fixture
def reference(plan, tmp_path_factory) -> Path:
    """The same plan baked here, once per module: what every other target must equal."""
    key = json.dumps(plan.plan, sort_keys=True)
    if key not in _references:
        report = bake(plan.plan_path, "--runs", str(tmp_path_factory.mktemp("here")))
        assert report["state"] == "done"
        _references[key] = Path(report["folder"])
    return _references[key]


def set_where(project, where) -> Path:
    project.plan["where"] = where
    return project.write()


# -- export --------------------------------------------------------------------------------


def unpack(bundle: Path, into: Path) -> Path:
    """Unpack a bundle as a user would, with tar; the job folder."""
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-xzf", str(bundle), "-C", str(into)], check=True)
    (job,) = into.iterdir()
    return job


def run_job(job: Path, *args: str, check: int | None = 0) -> subprocess.CompletedProcess:
    """The bundle's script, run in its own folder by this venv's python, as elsewhere."""
    proc = subprocess.run([sys.executable, "run.py", *args], cwd=job, capture_output=True, text=True,
                          env={**os.environ, "HF_TOKEN": SECRET}, timeout=600)
    if check is not None:
        assert proc.returncode == check, proc.stdout + proc.stderr
    return proc


def export(plan_path: Path) -> tuple[dict, Path]:
    report = bake(plan_path, env={"HF_TOKEN": SECRET})
    assert report["state"] == "stopped", report
    folder = Path(report["folder"])
    (bundle,) = (folder / "export").glob("*.tar.gz")
    return report, bundle


def test_export_run_elsewhere_import_then_bake_equals_here(plan, reference, tmp_path):
    plan_path = set_where(plan, "export")
    started = time.monotonic()
    report, bundle = export(plan_path)
    folder = Path(report["folder"])
    assert report["ran"] == ["resolve", "base", "split", "config"]
    assert report["message"].startswith(f"exported: {os.path.relpath(bundle)}; run it anywhere")
    assert "overbrainer import" in report["message"]
    assert not (folder / ".stamps" / "train.json").exists()  # train is not done
    status = json.loads((folder / "run.json").read_text())
    assert status["where"] == "export" and status["state"] == "stopped"

    fp = json.loads((folder / "export" / "job.json").read_text())["fingerprint"]
    assert bundle.name == f"tiny-{fp[:8]}.tar.gz"
    with tarfile.open(bundle) as tar:
        names = set(tar.getnames())
        config = tar.extractfile(f"tiny-{fp[:8]}/run/config.yaml").read().decode()
        manifest = json.loads(tar.extractfile(f"tiny-{fp[:8]}/MANIFEST.json").read())
    top = f"tiny-{fp[:8]}/"
    assert {top + n for n in ("MANIFEST.json", "job.json", "run.py", "run.sh", "README.txt", "run/config.yaml",
                              "run/train.parquet", "run/validation.parquet", "base/config.json", "base/model.safetensors")} <= names
    assert not any("checkpoints" in n for n in names)  # nothing to resume from yet
    assert "base_model: ../base" in config
    assert {f["path"] for f in manifest["files"]} == {n[len(top):] for n in names} - {"MANIFEST.json"}
    secret_free(folder)

    job = unpack(bundle, tmp_path / "elsewhere")
    t0 = time.monotonic()
    out = run_job(job)
    job_seconds = time.monotonic() - t0
    assert "the result is" in out.stdout and (job / "result.tar.gz").is_file()
    secret_free(job)  # the job ran with HF_TOKEN set: nothing of it in what comes back

    imported = cli("import", str(folder), str(job / "result.tar.gz"))
    assert f"the job is done (step {STEPS})" in imported.stdout
    again = bake(plan_path)
    assert again["state"] == "done" and again["ran"] == ["train", "merge", "bake"]
    assert weights(folder) == weights(reference)
    assert losses(folder) == losses(reference)
    assert (folder / "merged/model.safetensors").read_bytes() == (reference / "merged/model.safetensors").read_bytes()
    assert "imported from result.tar.gz" in (folder / "log.txt").read_text()
    assert f"step {STEPS}/{STEPS}" in (folder / "log.txt").read_text()
    secret_free(folder)
    assert bake(plan_path)["ran"] == []  # and then it is a finished plan like any other
    print(f"export round trip: {time.monotonic() - started:.1f} s, the job itself {job_seconds:.1f} s")


def test_export_stopped_there_resumes_from_its_checkpoint(plan, reference, tmp_path):
    plan_path = set_where(plan, "export")
    report, bundle = export(plan_path)
    folder = Path(report["folder"])
    job = unpack(bundle, tmp_path / "first")
    proc = subprocess.Popen([sys.executable, "run.py"], cwd=job, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    with held(hold_at_step(job / "run", 2)):  # still at step 2, until the stop is there
        subprocess.run([sys.executable, "run.py", "stop"], cwd=job, check=True, capture_output=True)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "stopped on request" in out
    stopped_at = json.loads((job / "run" / "stopped.json").read_text())["step"]
    assert 2 <= stopped_at < STEPS

    imported = cli("import", str(folder), str(job / "result.tar.gz"))
    assert f"the job stopped at step {stopped_at}" in imported.stdout
    assert (folder / "stopped.json").is_file()
    resumed = bake(plan_path)
    assert resumed["state"] == "stopped"
    assert resumed["message"].startswith(f"the job stopped at step {stopped_at}; exported: ")
    (bundle,) = (folder / "export").glob("*.tar.gz")
    with tarfile.open(bundle) as tar:
        carried = {n.split("/")[3] for n in tar.getnames() if "/run/checkpoints/" in n}
    assert carried == {f"step-{stopped_at:06d}"}  # the newest checkpoint travels, and only it

    job = unpack(bundle, tmp_path / "second")
    run_job(job)
    assert f"resuming from step-{stopped_at:06d}" in (job / "run" / "log.txt").read_text()
    cli("import", str(folder), str(job / "result.tar.gz"))
    assert not (folder / "stopped.json").exists()  # the earlier stop is over
    done = bake(plan_path)
    assert done["state"] == "done"
    assert weights(folder) == weights(reference)
    assert losses(folder) == losses(reference)


def test_a_job_checks_its_files_and_its_base_before_training(plan, tmp_path):
    plan_path = set_where(plan, "export")
    _, bundle = export(plan_path)
    job = unpack(bundle, tmp_path / "elsewhere")

    moved = tmp_path / "base-elsewhere"
    shutil.move(job / "base", moved)  # as if the bundle came without its base
    out = run_job(job, check=2)
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]  # one line
    assert "python run.py --base PATH" in out.stderr
    wrong = tmp_path / "wrong-base"
    shutil.copytree(moved, wrong)
    with open(wrong / "config.json", "a") as f:
        f.write(" ")
    out = run_job(job, "--base", str(wrong), check=2)
    assert "config.json differs from the one this job was made with" in out.stderr

    shutil.move(moved, job / "base")
    with open(job / "run" / "train.parquet", "ab") as f:
        f.write(b"\0")  # damaged on the way
    out = run_job(job, check=2)
    assert "run/train.parquet differs" in out.stderr and "copy it again" in out.stderr
    assert json.loads((job / "end.json").read_text())["exit"] == 2
    assert not (job / "run" / "checkpoints").exists()


# -- hostile and broken results --------------------------------------------------------------


def _artifacts() -> dict:
    from overbrainer.trainers.builtin import Builtin

    art = Builtin().artifacts()
    return {"entries": art.entries, "exclude": art.exclude, "required": art.required}


@pytest.fixture
def exported_run(tmp_path):
    """A run folder that exported a job (its export/job.json), and a result maker."""
    folder = tmp_path / "runs" / "tiny"
    (folder / "export").mkdir(parents=True)
    fp = "f" * 64
    (folder / "export" / "job.json").write_text(json.dumps({"fingerprint": fp, "artifacts": _artifacts()}))
    (folder / "run.json").write_text(json.dumps({"state": "stopped", "where": "export"}))
    (folder / ".lock").touch()  # every baked run folder has its lock file
    return folder, fp


def make_result(path: Path, fp: str, files: dict[str, bytes], extra=(), end=None, listed=None) -> Path:
    """A result tar: result.json listing `files` (path → content), the files, then the
    `extra` members (TarInfo, content) as given."""
    from overbrainer.hashing import hash_bytes

    end = end if end is not None else {"exit": 0, "stopped": False, "error": None, "fingerprint": fp}
    manifest = [{"path": p, "size": len(d), "hash": hash_bytes(d)} for p, d in (listed or files).items()]
    result = json.dumps({"format": 1, "name": "tiny", "fingerprint": fp, "end": end, "files": manifest}).encode()
    with tarfile.open(path, "w:gz") as tar:
        for name, data in [("result.json", result), *files.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info, data in extra:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


GOOD = {"checkpoints/step-000002/meta.json": b'{"step": 2}', "metrics.jsonl": b'{"step": 2, "loss": 1.0}\n'}


def tree(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def member(name: str, kind: bytes, link: str = "", data: bytes | None = None) -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    if kind == tarfile.CHRTYPE:
        info.devmajor, info.devminor = 1, 3
    if data is not None:
        info.size = len(data)
    return info, data


HOSTILE = {
    "dotdot": (lambda t: member("../evil.txt", tarfile.REGTYPE, data=b"x"), "would land outside the run folder"),
    "absolute": (lambda t: member(f"{t}/abs-evil.txt", tarfile.REGTYPE, data=b"x"), "is an absolute path"),
    "symlink": (lambda t: member("checkpoints/link", tarfile.SYMTYPE, "/etc/passwd"), "is a symbolic link"),
    "hardlink": (lambda t: member("checkpoints/hard", tarfile.LNKTYPE, "/etc/passwd"), "is a hard link"),
    "fifo": (lambda t: member("checkpoints/fifo", tarfile.FIFOTYPE), "is a FIFO"),
    "device": (lambda t: member("checkpoints/null", tarfile.CHRTYPE), "is a device file"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_result_is_refused_in_one_line_and_writes_nothing(exported_run, tmp_path, kind):
    folder, fp = exported_run
    make_member, why = HOSTILE[kind]
    result = make_result(tmp_path / "result.tar.gz", fp, GOOD, extra=[make_member(tmp_path)])
    before, around = tree(folder), tree(tmp_path / "runs")
    proc = cli("import", str(folder), str(result), check=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "refused, nothing imported" in lines[0] and why in lines[0], proc.stderr
    assert tree(folder) == before and tree(tmp_path / "runs") == around
    assert not (tmp_path / "abs-evil.txt").exists() and not (tmp_path / "runs" / "evil.txt").exists()


def test_a_good_result_imports_and_leaves_excluded_names_out(exported_run, tmp_path):
    """The control of the hostile cases: the same result without them goes in."""
    folder, fp = exported_run
    (folder / "stopped.json").write_text("{}")  # an earlier attempt's stop
    tmp = member("checkpoints/.tmp-step-000003-99/meta.json", tarfile.REGTYPE, data=b"partial")
    result = make_result(tmp_path / "result.tar.gz", fp, GOOD, extra=[tmp])
    proc = cli("import", str(folder), str(result))
    assert "imported 2 files" in proc.stdout
    assert (folder / "checkpoints/step-000002/meta.json").read_bytes() == GOOD["checkpoints/step-000002/meta.json"]
    assert not (folder / "checkpoints" / ".tmp-step-000003-99").exists()  # excluded: left out
    assert not (folder / "stopped.json").exists()  # the job no longer has it
    assert json.loads((folder / "export" / "imported.json").read_text())["state"] == "done"


@pytest.mark.parametrize("case", ["damaged", "other-job", "unlisted", "not-an-artifact", "twice"])
def test_a_broken_result_is_refused_and_writes_nothing(exported_run, tmp_path, case):
    folder, fp = exported_run
    files, extra, listed, expect = dict(GOOD), [], None, ""
    if case == "damaged":
        listed = {**GOOD, "metrics.jsonl": b"x" * len(GOOD["metrics.jsonl"])}  # same size, other bytes
        expect = "blake3 differs"
    elif case == "other-job":
        fp, expect = "0" * 64, "the result of another job"
    elif case == "unlisted":
        extra, expect = [member("checkpoints/step-000002/extra.bin", tarfile.REGTYPE, data=b"x")], "not in its result.json"
    elif case == "not-an-artifact":
        extra, expect = [member("config.yaml", tarfile.REGTYPE, data=b"x")], "not among what the job brings back"
    elif case == "twice":
        extra, expect = [member("metrics.jsonl", tarfile.REGTYPE, data=b"x")], "appears twice"
    result = make_result(tmp_path / "result.tar.gz", fp, files, extra=extra, listed=listed)
    before = tree(folder)
    proc = cli("import", str(folder), str(result), check=2)
    assert len(proc.stderr.strip().splitlines()) == 1 and expect in proc.stderr, proc.stderr
    assert tree(folder) == before


def test_a_successful_job_with_no_checkpoint_is_recorded_failed_yet_brought_back(exported_run, tmp_path):
    folder, fp = exported_run
    files = {"metrics.jsonl": GOOD["metrics.jsonl"], "log.txt": b"the trainer's output\n"}
    result = make_result(tmp_path / "result.tar.gz", fp, files)
    proc = cli("import", str(folder), str(result), check=1)
    assert "brought nothing back in checkpoints/" in proc.stderr
    assert (folder / "metrics.jsonl").read_bytes() == files["metrics.jsonl"]  # what it had came back
    assert "the trainer's output" in (folder / "log.txt").read_text()
    assert json.loads((folder / "run.json").read_text())["state"] == "failed"
    assert json.loads((folder / "export" / "imported.json").read_text())["state"] == "failed"


def test_the_job_script_needs_only_the_standard_library():
    """run.py runs where overbrainer is not installed: the portable folder it ships with
    imports the standard library, blake3, and the hub client only when it downloads a base."""
    import overbrainer.portable as portable

    modules = set()
    for source in portable.FOLDER.glob("*.py"):
        if source.name == "axolotl_plugin.py":
            continue  # runs in Axolotl's environment, with Axolotl's packages
        tree_ = ast.parse(source.read_text())
        modules |= {a.name.split(".")[0] for n in ast.walk(tree_) if isinstance(n, ast.Import) for a in n.names}
        modules |= {n.module.split(".")[0] for n in ast.walk(tree_) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert modules - set(sys.stdlib_module_names) == {"blake3", "huggingface_hub"}


def test_a_hub_base_is_downloaded_by_the_job_at_its_commit_and_checked(tiny_model, tmp_path, monkeypatch):
    """A bundle does not carry a hub base: run.py fetches it at the pinned commit (here a
    stand-in for huggingface_hub, no network) and checks every file before training."""
    import types

    import overbrainer.portable.runner as job
    from overbrainer.hashing import hash_file

    files = [{"path": p.name, "size": p.stat().st_size, "hash": hash_file(p)} for p in sorted(tiny_model.iterdir())]
    spec = {"base": {"files": files, "hub": {"repo": "org/tiny", "commit": "c0ffee" * 6}, "carried": False}}
    asked = []

    def snapshot_download(repo, revision, local_dir, allow_patterns):
        asked.append((repo, revision, sorted(allow_patterns)))
        shutil.copytree(served, local_dir)

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=snapshot_download))
    served = tiny_model
    home = tmp_path / "job"
    home.mkdir()
    base = job.resolve_base(home, spec, None)
    assert asked == [("org/tiny", "c0ffee" * 6, sorted(f["path"] for f in files))]
    assert (base / "model.safetensors").read_bytes() == (tiny_model / "model.safetensors").read_bytes()
    assert job.resolve_base(home, spec, None) == base and len(asked) == 1  # once

    served = tmp_path / "moved-on"  # the hub has other bytes under that name
    shutil.copytree(tiny_model, served)
    (served / "config.json").write_text("{}")
    other = tmp_path / "job2"
    other.mkdir()
    with pytest.raises(job.JobError, match="config.json differs from the one this job was made with"):
        job.resolve_base(other, spec, None)
    assert not (other / "base").exists()


# -- ssh -------------------------------------------------------------------------------------


class SSHD:
    def __init__(self, port: int, key: Path, known_hosts: Path, log: Path):
        self.port, self.key, self.known_hosts, self.log = port, key, known_hosts, log


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A real sshd on 127.0.0.1 (a free port), with a host key and an authorized key made
    here; root only (it runs as CI does)."""
    exe = shutil.which("sshd") or "/usr/sbin/sshd"
    if not Path(exe).is_file():
        pytest.skip("sshd is not installed (Debian: apt-get install openssh-server; .ci/run installs it)")
    if os.geteuid() != 0:
        pytest.skip("the ssh test starts sshd as root, as CI does")
    d = tmp_path_factory.mktemp("sshd")
    for name in ("host_key", "id_ed25519"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    shutil.copy(d / "id_ed25519.pub", d / "authorized_keys")
    port = _free_port()
    (d / "sshd_config").write_text(
        f"HostKey {d}/host_key\nAuthorizedKeysFile {d}/authorized_keys\nPidFile {d}/sshd.pid\n"
        f"ListenAddress {LOOPBACK}\nStrictModes no\nUsePAM no\nPermitRootLogin yes\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder
    log = d / "sshd.log"
    proc = subprocess.Popen([exe, "-D", "-e", "-p", str(port), "-f", str(d / "sshd_config")],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)

    def listening():
        assert proc.poll() is None, log.read_text()
        with socket.socket() as s:
            return s.connect_ex((LOOPBACK, port)) == 0

    wait_for(listening, timeout=20)
    yield SSHD(port, d / "id_ed25519", d / "known_hosts", log)
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def over_ssh(sshd, monkeypatch, tmp_path):
    """The client side: no user or system ssh config, its own known_hosts (nothing of ~),
    and the job run by this venv's python (the remote is this machine)."""
    monkeypatch.setenv("OVERBRAINER_SSH_COMMAND", f"ssh -F /dev/null -o UserKnownHostsFile={sshd.known_hosts}")
    monkeypatch.setenv("OVERBRAINER_REMOTE_PYTHON", sys.executable)
    workdir = tmp_path / "remote"
    return {"ssh": f"root@{LOOPBACK}", "port": sshd.port, "identity": str(sshd.key), "workdir": str(workdir)}


def test_ssh_bake_equals_here(plan, reference, over_ssh, sshd):
    plan_path = set_where(plan, over_ssh)
    started = time.monotonic()
    report = bake(plan_path, env={"HF_TOKEN": SECRET})
    seconds = time.monotonic() - started
    assert report["state"] == "done", report
    folder = Path(report["folder"])
    assert weights(folder) == weights(reference)
    assert losses(folder) == losses(reference)
    status = json.loads((folder / "run.json").read_text())
    assert status["where"] == f"ssh://root@{LOOPBACK}:{sshd.port}{over_ssh['workdir']}"
    assert status["step"] == STEPS

    remote = Path(over_ssh["workdir"])
    fp = json.loads((folder / ".stamps" / "train.json").read_text())["fingerprint"]
    (job,) = (remote / "runs").iterdir()
    assert job.name == f"tiny-{fp[:8]}"
    assert (job / "run" / FINAL).read_bytes() == weights(folder)
    assert json.loads((job / "end.json").read_text())["exit"] == 0
    (base,) = (remote / "bases").iterdir()
    assert (base / "model.safetensors").is_file()
    log = (folder / "log.txt").read_text()
    assert f"step {STEPS}/{STEPS}" in log  # the job's output, followed into the run's log
    secret_free(remote)
    secret_free(folder)
    assert bake(plan_path)["ran"] == []
    print(f"ssh bake: {seconds:.1f} s")


def test_ssh_stop_there_then_resume(plan, reference, over_ssh):
    plan_path = set_where(plan, over_ssh)
    folder = Path(os.environ["OVERBRAINER_RUNS"]) / "tiny"
    cli("bake", str(plan_path), "--detach", env={"HF_TOKEN": SECRET})
    (job,) = wait_for(lambda: list((Path(over_ssh["workdir"]) / "runs").glob("tiny-*")))
    # the trainer there (this machine) is held at step 2 until the stop has travelled to it
    trainers = hold_at_step(job / "run", 2)
    try:
        # the job's metrics come here while it runs: run.json's step moves
        wait_for(lambda: (json.loads((folder / "run.json").read_text()).get("step") or 0) >= 2)
        assert len(metric_steps(folder / "metrics.jsonl")) >= 2
        stopped = stop_held(folder, trainers, job / "run" / "stop", "--timeout", "300")
    finally:
        release(trainers)
    assert "stopped" in stopped, stopped
    assert json.loads((job / "end.json").read_text())["stopped"] is True
    step = json.loads((folder / "stopped.json").read_text())["step"]  # brought back
    assert 2 <= step < STEPS
    assert (folder / "checkpoints" / f"step-{step:06d}" / "meta.json").is_file()
    assert not (folder / ".stamps" / "train.json").exists()
    status = json.loads((folder / "run.json").read_text())
    assert status["state"] == "stopped" and status["where"].startswith("ssh://")

    done = bake(plan_path)
    assert done["state"] == "done", done
    assert f"resuming from step-{step:06d}" in (job / "run" / "log.txt").read_text()
    assert weights(folder) == weights(reference)
    assert losses(folder) == losses(reference)


def _wheel(folder: Path) -> Path:
    """A one-module wheel, made by hand: what the tools venv installs (no index, no build)."""
    import base64
    import hashlib
    import zipfile

    files = {"obtool.py": b"VERSION = '1'\n",
             "obtool-1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: obtool\nVersion: 1\n",
             "obtool-1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
        for name, data in files.items()) + "obtool-1.dist-info/RECORD,,\n"
    path = folder / "obtool-1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in {**files, "obtool-1.dist-info/RECORD": record.encode()}.items():
            z.writestr(name, data)
    return path


def test_ssh_tools_are_made_once_there(over_ssh, monkeypatch, tmp_path):
    """Without OVERBRAINER_REMOTE_PYTHON the job's Python is a venv made under tools/ with
    what OVERBRAINER_REMOTE_INSTALL names (the trainer's requirements by default), once."""
    from overbrainer.plan import SSHTarget
    from overbrainer.trainers.builtin import Builtin
    from overbrainer.where.ssh import SSH

    monkeypatch.delenv("OVERBRAINER_REMOTE_PYTHON")
    monkeypatch.setenv("OVERBRAINER_REMOTE_INSTALL", f"--no-index {_wheel(tmp_path)}")
    said = []
    target = SSH(SSHTarget(**over_ssh), base=None, hashes=None, plan_dir=tmp_path, say=said.append)
    try:
        root = target.must(f"mkdir -p {over_ssh['workdir']} && cd {over_ssh['workdir']} && pwd", "a test").decode().strip()
        log = tmp_path / "log.txt"
        python = target.tools(Builtin(), root, log)
        assert python.startswith(f"{over_ssh['workdir']}/tools/builtin-") and python.endswith("/bin/python")
        assert subprocess.run([python, "-c", "import obtool"], check=False).returncode == 0
        assert target.tools(Builtin(), root, log) == python
        assert len([s for s in said if "installing" in s]) == 1  # the second time finds it made
    finally:
        target.close()


@pytest.mark.parametrize("there", ["running", "ended"])
def test_ssh_bake_killed_here_takes_up_the_job_there(plan, reference, over_ssh, there):
    """A bake killed here leaves the job going on there: the next bake follows it (still
    running) or brings back what it made (ended meanwhile), never starting it twice."""
    import signal

    plan_path = set_where(plan, over_ssh)
    folder = Path(os.environ["OVERBRAINER_RUNS"]) / "tiny"
    cli("bake", str(plan_path), "--detach")
    (job,) = wait_for(lambda: list((Path(over_ssh["workdir"]) / "runs").glob("tiny-*")))
    trainers = hold_at_step(job / "run", 1)  # still there while the bake here is killed
    try:
        wait_for(lambda: (json.loads((folder / "run.json").read_text()).get("step") or 0) >= 1)
        os.kill(json.loads((folder / "run.json").read_text())["process"]["pid"], signal.SIGKILL)
        assert not (job / "end.json").exists()  # the job goes on there without the bake
        if there == "ended":
            release(trainers)
            wait_for(lambda: (job / "end.json").exists(), timeout=300)
            done = bake(plan_path)
        else:  # the next bake finds it running, and follows it
            again = cli_started("bake", str(plan_path), "--json")
            wait_for(lambda: "following the job already running" in (folder / "log.txt").read_text())
            release(trainers)
            out, err = again.communicate(timeout=600)
            assert again.returncode == 0, err
            done = json.loads(out.strip().splitlines()[-1])
    finally:
        release(trainers)
    assert done["state"] == "done", done
    said = {"running": "following the job already running", "ended": "had ended well: its artifacts are back"}
    assert said[there] in (folder / "log.txt").read_text()
    assert (job / "run" / "log.txt").read_text().count("--- ") == 1  # it was not started twice
    assert weights(folder) == weights(reference)
    assert losses(folder) == losses(reference)
