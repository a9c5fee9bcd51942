"""where: {"slurm": ...} against a real Slurm: Debian's slurm-wlm (slurmctld + slurmd) and
munge, started here for one node "localhost" with this machine's CPUs, their state in a
temp folder and their ports free ports of 127.0.0.1 (as root, as CI runs; .ci/run
installs the packages). `two_nodes` starts a second Slurm of two nodes, node1 and node2,
each slurmd in its own network namespace on a bridge of this machine, for a run across
nodes. The tests skip only when the daemons (or those namespaces) cannot start, saying why.

The run folder is on the filesystem the "cluster" shares (this machine's): a bake through
Slurm ends with the same adapter weights and losses, bit for bit, as one here."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import cli, hold_at_step, release, stop_held

STEPS = 24
FINAL = f"checkpoints/step-{STEPS:06d}/adapter_model.safetensors"
DAEMONS = ("munged", "slurmctld", "slurmd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _can_start() -> None:
    missing = [d for d in DAEMONS if not (shutil.which(d) or Path(f"/usr/sbin/{d}").exists())]
    if missing:
        pytest.skip(f"Slurm cannot start: {', '.join(missing)} not installed (Debian: apt-get install slurm-wlm munge; "
                    ".ci/run installs them)")
    if os.geteuid() != 0:
        pytest.skip("Slurm cannot start: the test starts slurmctld, slurmd and munged as root, as CI does")


def _slurm_conf(d: Path, controller: str, nodes: list[str]) -> Path:
    """slurm.conf of a test cluster in folder `d` (state, spool and logs in it, its own
    munge socket, free ports): `controller` is SlurmctldHost, `nodes` its NodeName lines,
    all in partition debug. %n in the slurmd paths is the node's name (several slurmd on
    this machine)."""
    d.chmod(0o755)  # munge wants its socket's folder reachable
    for sub in ("state", "spool", "log"):
        (d / sub).mkdir()
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    names = ",".join(line.split()[0].split("=", 1)[1] for line in nodes)
    conf = d / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=overbrainer-test", f"SlurmctldHost={controller}",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
        # cred_expire: how long a requeued job waits before it starts again (120 s by default)
        "AuthType=auth/munge", f"AuthInfo=socket={d}/munge.sock,cred_expire=30", "CredType=cred/munge",
        "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool/%n",
        f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/log/slurmctld.log", f"SlurmdLogFile={d}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=1", "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none", "JobCompType=jobcomp/none", "MpiDefault=none",
        "ReturnToService=2", "KillWait=30", "MinJobAge=600", "InactiveLimit=0",
        *nodes, f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP", "",
    ]))
    return conf


@contextmanager
def _daemons(conf: Path, slurmd: list[list[str]], nodes: int):
    """munged and slurmctld of `conf`'s folder, then each `slurmd` command line; yields
    once sinfo shows `nodes` nodes up, and ends them all with SIGTERM (slurmd first).
    Skips, saying which daemon and why, when one cannot start."""
    d = conf.parent
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started = [
        ["munged", "-f", f"--key-file={d}/munge.key", f"--socket={d}/munge.sock", f"--pid-file={d}/munged.pid",
         f"--log-file={d}/log/munged.log", f"--seed-file={d}/munged.seed"],
        ["slurmctld", "-i"],
        *slurmd,
    ]
    try:
        for argv in started:
            out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
            if out.returncode != 0:
                pytest.skip(f"Slurm cannot start: {' '.join(argv[:6])} exited {out.returncode}: "
                            f"{out.stderr.strip()[-300:] or f'see its log in {d}/log'}")
        deadline = time.monotonic() + 60
        while True:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True)
            states = out.stdout.split()
            if out.returncode == 0 and len(states) == nodes and set(states) <= {"idle", "mixed", "allocated"}:
                break
            if time.monotonic() > deadline:
                log = (d / "log" / "slurmctld.log").read_text()[-500:] if (d / "log" / "slurmctld.log").exists() else ""
                pytest.skip(f"Slurm cannot start: its nodes are not up after 60 s ({out.stdout.strip()} "
                            f"{out.stderr.strip()}) {log}")
            time.sleep(0.2)
        yield conf
    finally:
        pids = [*d.glob("slurmd*.pid"), d / "slurmctld.pid", d / "munged.pid"]
        for path in pids:
            pid = _pid(path)
            if pid:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node Slurm of this machine; yields its slurm.conf (tests set $SLURM_CONF)."""
    _can_start()
    conf = _slurm_conf(tmp_path_factory.mktemp("slurm"), "localhost",
                       [f"NodeName=localhost CPUs={os.cpu_count()} State=UNKNOWN"])
    (conf.parent / "spool" / "localhost").mkdir()
    with _daemons(conf, [["slurmd", "-N", "localhost"]], 1):
        yield conf


# -- two nodes, each in its own network namespace ---------------------------------------------

NODES = {"node1": "10.77.0.11", "node2": "10.77.0.12"}
CONTROLLER = "10.77.0.1"  # this machine's side of the bridge the nodes hang on


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {out.stderr.strip() or f'exit {out.returncode}'}")


@contextmanager
def _network(tag: str):
    """A bridge on this machine (CONTROLLER/24) and, for each of NODES, a network namespace
    on it through a veth pair, with the node's address and its own loopback. Yields {node:
    namespace}; takes it all away."""
    if shutil.which("ip") is None:
        pytest.skip("two Slurm nodes cannot start: no `ip` (iproute2) to make their network namespaces")
    bridge, spaces, links = f"{tag}br", {}, []
    try:
        try:
            _ip("link", "add", bridge, "type", "bridge")
            links.append(bridge)
            _ip("addr", "add", f"{CONTROLLER}/24", "dev", bridge)
            _ip("link", "set", bridge, "up")
            for i, (name, addr) in enumerate(NODES.items(), 1):
                ns, here, there = f"{tag}n{i}", f"{tag}v{i}", f"{tag}p{i}"
                _ip("netns", "add", ns)
                spaces[name] = ns
                _ip("link", "add", here, "type", "veth", "peer", "name", there)
                links.append(here)
                _ip("link", "set", there, "netns", ns)
                _ip("link", "set", here, "master", bridge)
                _ip("link", "set", here, "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", there)
                _ip("-n", ns, "link", "set", there, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except OSError as e:
            pytest.skip(f"two Slurm nodes cannot start: their network namespaces cannot be made ({e})")
        yield spaces
    finally:
        for link in reversed(links):  # a veth goes with its peer in the namespace
            subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)
        for ns in spaces.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A two-node Slurm on this machine: slurmctld here, and slurmd node1 and node2 each in
    its own network namespace (its own address, NODES), UTS namespace (its hostname is its
    node name) and mount namespace, where a hosts file that names every node is bound over
    /etc/hosts (torchrun's rendezvous and gloo find the nodes by name, as on a cluster; this
    machine's /etc/hosts is not touched). The filesystem is otherwise the same for all.
    Yields its slurm.conf."""
    _can_start()
    with _network(f"ob{os.getpid()}") as spaces:
        nodes = [f"NodeName={name} NodeAddr={addr} CPUs=1 State=UNKNOWN" for name, addr in NODES.items()]
        conf = _slurm_conf(tmp_path_factory.mktemp("slurm2"), f"localhost({CONTROLLER})", nodes)
        hosts = conf.parent / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n" for name, addr in NODES.items()))
        slurmd = []
        for name, ns in spaces.items():
            (conf.parent / "spool" / name).mkdir()
            node = f"mount --bind {shlex.quote(str(hosts))} /etc/hosts && hostname {name} && exec slurmd -N {name}"
            slurmd.append(["nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts", "sh", "-c", node])
        with _daemons(conf, slurmd, len(NODES)):
            try:
                yield conf
            finally:  # a job a failed test left behind would outlive its slurmd in the namespaces
                subprocess.run(["scancel", "--full", "--name=overbrainer-tiny"], capture_output=True, timeout=30,
                               env={**os.environ, "SLURM_CONF": str(conf)}, check=False)


@pytest.fixture
def cluster(slurm, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(slurm))
    monkeypatch.setenv("OVERBRAINER_SLURM_POLL", "0.3")
    yield slurm
    subprocess.run(["scancel", "--full", "--name=overbrainer-tiny"], check=False)


def bake(plan: Path, *args: str, check: int | None = 0) -> dict:
    proc = cli("bake", str(plan), "--json", *args, check=check)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def losses(folder: Path) -> list:
    records = map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
    return [(m["step"], m["loss"], m.get("eval_loss")) for m in records if "step" in m]


def run_json(folder: Path) -> dict:
    return json.loads((folder / "run.json").read_text())


def wait_for(what, timeout: float = 180, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def in_queue(job: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
    return bool(out.stdout.strip())


_references: dict[str, Path] = {}


@pytest.fixture
def plan(project):
    project.write(steps=STEPS)
    return project


@pytest.fixture
def reference(plan, tmp_path_factory) -> Path:
    key = json.dumps(plan.plan, sort_keys=True)
    if key not in _references:
        report = bake(plan.plan_path, "--runs", str(tmp_path_factory.mktemp("here")))
        assert report["state"] == "done"
        _references[key] = Path(report["folder"])
    return _references[key]


def on_slurm(project, **settings) -> Path:
    project.plan["where"] = {"slurm": settings}
    return project.write()


def same_model(folder: Path, reference: Path) -> None:
    assert (folder / FINAL).read_bytes() == (reference / FINAL).read_bytes()
    assert losses(folder) == losses(reference)


def test_slurm_bake_equals_here(plan, reference, cluster):
    plan_path = on_slurm(plan, partition="debug", time="10:00", grace=30)
    report = bake(plan_path)
    assert report["state"] == "done", report
    folder = Path(report["folder"])
    same_model(folder, reference)
    status = run_json(folder)
    assert status["where"] == "slurm:debug" and status["slurm_job"]
    # merge and bake ran here (where.slurm.steps by default: ["train"]), after the job
    assert status["slurm_jobs"] == {"train": status["slurm_job"]} and not (folder / "slurm" / "merge.sh").exists()
    assert (folder / "baked" / "model.safetensors").read_bytes() == (reference / "baked" / "model.safetensors").read_bytes()
    script = (folder / "job.sh").read_text()
    for line in ("#SBATCH --partition=debug", "#SBATCH --time=10:00", "#SBATCH --signal=B:USR1@30",
                 "#SBATCH --nodes=1", "#SBATCH --no-requeue"):
        assert line in script.splitlines()
    end = json.loads((folder / "slurm" / f"end-{status['slurm_job']}.json").read_text())
    assert end["exit"] == 0 and end["signal"] is None
    assert bake(plan_path)["ran"] == []


def test_a_pending_job_is_queued_with_its_reason_and_a_stop_cancels_it(plan, cluster):
    plan_path = on_slurm(plan, cpus_per_task=64 * (os.cpu_count() or 1))  # more than the node has
    cli("bake", str(plan_path), "--detach")
    folder = Path(os.environ["OVERBRAINER_RUNS"]) / "tiny"
    status = wait_for(lambda: (s := run_json(folder)).get("state") == "queued" and s)
    assert status["reason"].startswith("Slurm: ") and len(status["reason"]) > len("Slurm: "), status
    shown = json.loads(cli("status", str(folder), "--json").stdout)
    assert shown["state"] == "queued", shown
    job = status["slurm_job"]
    assert in_queue(job)
    out = cli("stop", str(folder), "--timeout", "120").stdout
    assert "stopped" in out, out
    assert not in_queue(job)
    assert run_json(folder)["state"] == "stopped"


def test_stop_then_resume(plan, reference, cluster):
    plan_path = on_slurm(plan)
    folder = Path(os.environ["OVERBRAINER_RUNS"]) / "tiny"
    cli("bake", str(plan_path), "--detach")
    trainers = hold_at_step(folder, 2)
    job = run_json(folder)["slurm_job"]
    try:
        stopped = stop_held(folder, trainers, folder / "stop", "--timeout", "300")
    finally:
        release(trainers)
    assert "stopped" in stopped, stopped
    assert not in_queue(job)
    step = json.loads((folder / "stopped.json").read_text())["step"]
    assert 2 <= step < STEPS
    done = bake(plan_path)
    assert done["state"] == "done", done
    assert run_json(folder)["slurm_job"] != job  # a new job went on
    assert f"resuming from step-{step:06d}" in (folder / "log.txt").read_text()
    same_model(folder, reference)


def test_scancel_by_hand_is_failed_and_a_rerun_resumes(plan, reference, cluster):
    plan_path = on_slurm(plan)
    folder = Path(os.environ["OVERBRAINER_RUNS"]) / "tiny"
    cli("bake", str(plan_path), "--detach")
    trainers = hold_at_step(folder, 2)
    job = run_json(folder)["slurm_job"]
    subprocess.run(["scancel", job], check=True)
    release(trainers)
    status = wait_for(lambda: (s := run_json(folder)).get("state") in ("failed", "done", "stopped") and s)
    assert status["state"] == "failed", status
    assert f"Slurm job {job} ended CANCELLED" in status["reason"], status
    done = bake(plan_path)
    assert done["state"] == "done", done
    assert "resuming from step-" in (folder / "log.txt").read_text()
    same_model(folder, reference)


def test_the_job_outlives_a_killed_follower_and_a_later_status_finds_it(plan, reference, cluster):
    plan_path = on_slurm(plan)
    folder = Path(os.environ["OVERBRAINER_RUNS"]) / "tiny"
    cli("bake", str(plan_path), "--detach")
    trainers = hold_at_step(folder, 2)
    try:
        status = run_json(folder)
        job = status["slurm_job"]
        os.kill(status["process"]["pid"], signal.SIGKILL)
        time.sleep(0.5)
        shown = json.loads(cli("status", str(folder), "--json").stdout)
        assert shown["state"] == "running", shown
        assert f"Slurm job {job} is RUNNING" in shown["reason"], shown
    finally:
        release(trainers)
    wait_for(lambda: not in_queue(job))
    shown = json.loads(cli("status", str(folder), "--json").stdout)
    assert shown["state"] == "failed" and "ended COMPLETED" in shown["reason"], shown
    done = bake(plan_path)  # takes up what the job made: no new job
    assert done["state"] == "done", done
    assert run_json(folder)["slurm_job"] == job
    same_model(folder, reference)


# -- bad input -----------------------------------------------------------------------------


def test_no_sbatch_on_the_path_is_one_line(plan, monkeypatch):
    plan_path = on_slurm(plan)
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    proc = cli("bake", str(plan_path), check=2)
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert any("the plan asks for Slurm" in ln and "no sbatch on the PATH" in ln for ln in lines), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (Path(os.environ["OVERBRAINER_RUNS"]) / "tiny" / "job.sh").exists()


def test_steps_the_cluster_cannot_take_are_refused_in_one_line(plan, tmp_path):
    for settings, said in (({"steps": ["merge", "bake"]}, 'list "train", then "merge" and "bake"'),
                           ({"steps": ["train", "merge"], "workdir": str(tmp_path)},
                            "where.slurm.steps sends merge to the cluster, which reads the run folder where it is")):
        proc = cli("bake", str(on_slurm(plan, **settings)), check=2)
        assert proc.stderr.count("\n") == 1 and said in proc.stderr, proc.stderr


def test_a_partition_slurm_rejects_is_its_message_in_one_line(plan, cluster):
    plan_path = on_slurm(plan, partition="nosuchpartition")
    proc = cli("bake", str(plan_path), check=2)
    assert "Slurm refused the job: sbatch: error: Batch job submission failed: Invalid partition name specified" \
        in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    folder = Path(os.environ["OVERBRAINER_RUNS"]) / "tiny"
    assert not (folder / "job.sh").exists() and not (folder / "slurm" / "submitted.json").exists()
    assert not (folder / ".stamps" / "train.json").exists()


def test_the_time_limit_warning_checkpoints_and_the_next_job_goes_on(plan, reference, cluster):
    """Slurm's warning before a time limit (--signal=B:USR1@grace), sent now by hand the way
    slurmctld sends it: the trainer saves, the job ends, the next job goes on, bit for bit."""
    plan_path = on_slurm(plan)
    folder = Path(os.environ["OVERBRAINER_RUNS"]) / "tiny"
    cli("bake", str(plan_path), "--detach")
    trainers = hold_at_step(folder, 2)
    job = run_json(folder)["slurm_job"]
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    wait_for(lambda: (folder / "stop").exists())
    release(trainers)
    status = wait_for(lambda: (s := run_json(folder)).get("state") in ("failed", "done", "stopped") and s, timeout=300)
    assert status["state"] == "done", status
    end = json.loads((folder / "slurm" / f"end-{job}.json").read_text())
    assert end["signal"] == "SIGUSR1" and end["exit"] == 0
    jobs = json.loads((folder / "slurm" / "submitted.json").read_text())["jobs"]
    assert jobs[0] == job and len(jobs) == 2 and status["slurm_job"] == jobs[1]
    assert "before its time limit; submitting the next" in (folder / "log.txt").read_text()
    same_model(folder, reference)


@pytest.mark.slow  # Slurm's own time limit: a minute or two of waiting for its warning
@pytest.mark.slurm_limits
def test_a_real_time_limit_ends_the_job_mid_run_and_the_next_job_finishes_it(plan, reference, cluster):
    """--time=4 with --signal=B:USR1@150: slurmctld itself warns the job 90 to 120 s in (it
    looks at time limits every 30 s or so; a loaded machine takes most of a minute to start
    the trainer), the trainer saves and the job ends before its limit, and the next jobs go
    on from the checkpoint to the same bits as a run here."""
    plan_path = on_slurm(plan, time="4", grace=150)
    folder = Path(os.environ["OVERBRAINER_RUNS"]) / "tiny"
    cli("bake", str(plan_path), "--detach")
    trainers = hold_at_step(folder, 2)  # mid-run when the warning comes
    job = run_json(folder)["slurm_job"]
    try:
        wait_for(lambda: (folder / "stop").exists(), timeout=240, every=0.5)
    finally:
        release(trainers)
    status = wait_for(lambda: (s := run_json(folder)).get("state") in ("failed", "done", "stopped") and s, timeout=600)
    assert status["state"] == "done", status
    end = json.loads((folder / "slurm" / f"end-{job}.json").read_text())
    assert end["signal"] == "SIGUSR1" and end["exit"] == 0, end
    jobs = json.loads((folder / "slurm" / "submitted.json").read_text())["jobs"]
    assert jobs[0] == job and len(jobs) >= 2 and status["slurm_job"] == jobs[-1]
    log = (folder / "log.txt").read_text()
    assert "before its time limit; submitting the next" in log and "resuming from step-" in log
    same_model(folder, reference)


@pytest.mark.slow  # a requeue: Slurm's SIGTERM, its KillWait, then the job again
@pytest.mark.slurm_limits
def test_a_requeued_job_goes_on_from_its_checkpoint(plan, reference, cluster):
    """"requeue": true, then `scontrol requeue` (what a preemption with PreemptMode=REQUEUE
    does): the job gets SIGTERM, the trainer saves and ends, Slurm runs job.sh again under
    the same job id, and it goes on from that checkpoint, no step lost, bit for bit."""
    plan_path = on_slurm(plan, requeue=True)
    folder = Path(os.environ["OVERBRAINER_RUNS"]) / "tiny"
    cli("bake", str(plan_path), "--detach")
    trainers = hold_at_step(folder, 2)
    job = run_json(folder)["slurm_job"]
    assert "#SBATCH --requeue" in (folder / "job.sh").read_text().splitlines()
    try:
        subprocess.run(["scontrol", "requeue", job], check=True)
    finally:
        release(trainers)
    status = wait_for(lambda: (s := run_json(folder)).get("state") in ("failed", "done", "stopped") and s, timeout=600)
    assert status["state"] == "done", status
    assert json.loads((folder / "slurm" / "submitted.json").read_text())["jobs"] == [job]  # Slurm's requeue, not ours
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True).stdout
    assert "Restarts=1" in out, out
    log = (folder / "log.txt").read_text()
    step = json.loads((folder / "stopped.json").read_text())["step"] if (folder / "stopped.json").exists() else None
    assert step is None  # the requeued run took the stop away and finished
    assert "resuming from step-" in log, log[-2000:]
    assert not (folder / "stop").exists()
    same_model(folder, reference)


def test_a_node_that_cannot_see_the_run_folder_is_one_line(plan, cluster):
    """The job runs where the run folder is not (here: what the bake wrote for it is gone
    before it starts, as on a node without the shared filesystem): one line, no training."""
    plan_path = on_slurm(plan, sbatch=["--begin=now+4"])
    folder = Path(os.environ["OVERBRAINER_RUNS"]) / "tiny"
    cli("bake", str(plan_path), "--detach")
    wait_for(lambda: run_json(folder).get("slurm_job"), every=0.05)
    (folder / "slurm" / "job.json").rename(folder / "slurm" / "job.json.away")
    status = wait_for(lambda: (s := run_json(folder)).get("state") in ("failed", "done", "stopped") and s, timeout=120)
    assert status["state"] == "failed", status
    job = status["slurm_job"]
    assert status["reason"].startswith(f"the Slurm job {job} cannot see the run folder {folder}"), status
    assert "\n" not in status["reason"] and not (folder / "checkpoints").exists()
    assert "cannot see the run folder" in (folder / "slurm" / f"{job}.out").read_text()


def test_workdir_stages_the_job_checks_it_and_brings_the_result_back(plan, reference, cluster, tmp_path):
    """"workdir": the job is staged there as an export bundle's job folder, for a run folder
    the nodes do not see: a copy damaged on the way is refused by its manifest, in one
    line, and the next bake stages it again, trains there and brings the result back
    through the import's checks, bit for bit."""
    scratch = tmp_path / "scratch"
    plan_path = on_slurm(plan, workdir=str(scratch), sbatch=["--begin=now+3"])
    folder = Path(os.environ["OVERBRAINER_RUNS"]) / "tiny"
    cli("bake", str(plan_path), "--detach")
    wait_for(lambda: run_json(folder).get("slurm_job"), every=0.05)
    [staged] = scratch.glob("tiny-*")
    assert (staged / "MANIFEST.json").is_file() and (staged / "base" / "config.json").is_file()
    with open(staged / "run" / "train.parquet", "ab") as f:
        f.write(b"\0")  # damaged on the way
    status = wait_for(lambda: (s := run_json(folder)).get("state") in ("failed", "done", "stopped") and s, timeout=180)
    assert status["state"] == "failed", status
    assert "run/train.parquet differs" in status["reason"] and "copy it again" in status["reason"], status
    assert "\n" not in status["reason"] and not (folder / "checkpoints").exists()

    report = bake(plan_path)
    assert report["state"] == "done", report
    same_model(folder, reference)
    script = (folder / "job.sh").read_text()
    assert f"-m overbrainer.where.slurm staged {staged}" in script and f"--output={staged}/run/slurm/%j.out" in script
    assert (staged / "result.tar.gz").is_file() and not (folder / "slurm" / "job.json").exists()
    job = run_json(folder)["slurm_job"]
    assert json.loads((staged / "run" / "slurm" / f"end-{job}.json").read_text())["exit"] == 0
    assert f"the Slurm job {job}'s result is back from {staged}" in (folder / "log.txt").read_text()


def test_across_nodes_keeps_the_trainers_own_arguments():
    """Two nodes: the built-in trainer's command under srun torchrun, its arguments after
    config.yaml (the plan's device) kept."""
    from overbrainer.where.slurm import across_nodes

    [command] = across_nodes([["python", "-m", "overbrainer.trainers.builtin", "config.yaml", "--device", "cuda"]], 2, 8)
    assert command[0] == "srun" and "--nproc-per-node=8" in command
    assert command[-5:] == ["-m", "overbrainer.trainers.builtin", "config.yaml", "--device", "cuda"]


def test_a_job_over_its_memory_says_what_to_ask_for():
    """Slurm's OUT_OF_MEMORY (the job went over its --mem): the line says to ask for more
    or, for training, to need less. (The test cluster enforces no memory limit, so no job
    of it ends this way: the line is checked as it is built from Slurm's state.)"""
    from overbrainer.where.slurm import JobState, ended_line

    train = ended_line("41", "train", JobState(("OUT_OF_MEMORY", "OutOfMemory")))
    assert train.startswith("the Slurm job 41 ended OUT_OF_MEMORY (OutOfMemory); bake again to go on from its "
                            "last checkpoint; it went over the memory Slurm gave it")
    assert '["--mem=..."]' in train and "train.micro_batch_size" in train
    merge = ended_line("42", "merge", JobState(("OUT_OF_MEMORY", "None")))
    assert merge.endswith('run merge again; it went over the memory Slurm gave it: ask for more '
                          '(where.slurm.sbatch: ["--mem=..."])')
    assert ended_line("43", "train", JobState(("FAILED", "NonZeroExitCode"))).endswith(
        "ended FAILED (NonZeroExitCode); bake again to go on from its last checkpoint")
    assert "without a trace" in ended_line("44", "train", None)


def test_merge_and_bake_sent_to_the_cluster_end_as_here_and_a_cancelled_merge_reruns(plan, reference, cluster):
    """where.slurm.steps: merge and bake as Slurm jobs of their own, stamped here. The
    partition goes down while training runs, so the merge job waits (PartitionDown):
    cancelled, it is failed with its reason; the partition up again, a rerun sends merge
    and bake and ends with the same weights as a bake here, every job id in run.json."""
    plan_path = on_slurm(plan, partition="debug", steps=["train", "merge", "bake"])
    folder = Path(os.environ["OVERBRAINER_RUNS"]) / "tiny"
    partition = ["scontrol", "update", "PartitionName=debug"]
    cli("bake", str(plan_path), "--detach")
    trainers = hold_at_step(folder, 2)
    try:
        subprocess.run([*partition, "State=DOWN"], check=True)
        release(trainers)
        status = wait_for(lambda: (s := run_json(folder)).get("state") == "queued" and s.get("task") == "merge" and s,
                          timeout=300)
        merge = status["slurm_jobs"]["merge"]
        assert status["slurm_job"] == merge and status["reason"].startswith("Slurm: Partition"), status
        subprocess.run(["scancel", merge], check=True)
        status = wait_for(lambda: (s := run_json(folder)).get("state") in ("failed", "done", "stopped") and s)
    finally:
        subprocess.run([*partition, "State=UP"], check=True)
    assert status["state"] == "failed", status
    assert f"the Slurm job {merge} (merge) ended CANCELLED" in status["reason"], status
    assert not (folder / "merged").exists() and not (folder / ".stamps" / "merge.json").exists()

    report = bake(plan_path)
    assert report["state"] == "done" and report["ran"] == ["merge", "bake"], report
    jobs = json.loads(cli("status", str(folder), "--json").stdout)["slurm_jobs"]
    assert sorted(jobs) == ["bake", "merge", "train"] and jobs["merge"] != merge, jobs
    assert f"Slurm jobs: train {jobs['train']}, merge {jobs['merge']}, bake {jobs['bake']}" in \
        cli("status", str(folder)).stdout
    for step in ("merge", "bake"):
        assert json.loads((folder / "slurm" / f"end-{jobs[step]}.json").read_text())["exit"] == 0
        assert f"-m overbrainer.where.slurm job {folder} {step}" in (folder / "slurm" / f"{step}.sh").read_text()
    log = (folder / "log.txt").read_text()
    assert f"merge: submitted as Slurm job {jobs['merge']}" in log and f"on_slurm {folder} merge\nmerge: " in log
    for weights in ("merged/model.safetensors", "baked/model.safetensors"):
        assert (folder / weights).read_bytes() == (reference / weights).read_bytes(), weights
    assert bake(plan_path)["ran"] == []


def test_two_nodes_train_as_two_processes_here(project, two_nodes, monkeypatch, tmp_path, tmp_path_factory):
    """nodes: 2 on two real slurmd, each in its own network namespace: srun starts torchrun
    on both, they meet at the first node's rendezvous, and the two ranks train over gloo
    between the namespaces. The same losses and adapter weights, bit for bit, as a world of
    two here (train.processes 2 under torchrun --standalone): the ranks take the same
    micro-batches and dropout streams, and a sum of two gradients is the same sum in either
    order. Each rank says where it ran through a sitecustomize on its PYTHONPATH (the job
    keeps the environment it was submitted with)."""
    steps = 4
    final = f"checkpoints/step-{steps:06d}"
    here = bake(project.write(steps=steps, processes=2, save_every=steps),
                "--runs", str(tmp_path_factory.mktemp("here2")))
    assert here["state"] == "done", here
    reference = Path(here["folder"])

    trace = tmp_path / "trace"
    trace.mkdir()
    (trace / "sitecustomize.py").write_text(
        "import os, socket\n"
        "if 'RANK' in os.environ and 'TORCHELASTIC_RUN_ID' in os.environ:  # a worker torchrun started\n"
        "    with open(os.path.join(os.path.dirname(__file__), 'rank-' + os.environ['RANK']), 'w') as f:\n"
        "        f.write(socket.gethostname() + ' of ' + os.environ['WORLD_SIZE'])\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(trace), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("SLURM_CONF", str(two_nodes))
    monkeypatch.setenv("OVERBRAINER_SLURM_POLL", "0.3")
    project.write(processes=1)  # one a node
    report = bake(on_slurm(project, nodes=2))
    assert report["state"] == "done", report
    folder = Path(report["folder"])
    job = run_json(folder)["slurm_job"]
    shown = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True).stdout
    assert " NodeList=node[1-2] " in shown and " NumNodes=2 " in shown, shown
    assert "--rdzv-endpoint=node1:29500" in (log := (folder / "log.txt").read_text())
    assert "shared by 2 processes" in log
    ranks = {p.name: p.read_text() for p in trace.glob("rank-*")}
    assert sorted(ranks) == ["rank-0", "rank-1"] and sorted(ranks.values()) == ["node1 of 2", "node2 of 2"], ranks
    assert json.loads((folder / final / "meta.json").read_text())["world_size"] == 2
    assert json.loads((folder / "slurm" / f"end-{job}.json").read_text())["exit"] == 0
    assert len(losses(folder)) == steps and losses(folder) == losses(reference)
    assert (folder / final / "adapter_model.safetensors").read_bytes() == \
        (reference / final / "adapter_model.safetensors").read_bytes()
