"""The built-in trainer (torch + transformers + peft): one process running `loop.py`, or
one per GPU (or CPU process) under torchrun.

    loop.py     the training loop: setup, train_step, evaluate, save, and `train`, the loop
    model.py    the model as config.yaml says (LoRA, QLoRA, checkpointing, compile, Liger)
                and its loss
    device.py   where it computes: the device, bf16, TF32, determinism, pinned copies, memory
    profile.py  train.profile: torch.profiler over a few steps, into the run folder's profile/
    ../dist.py  the ranks: DDP, no_sync during accumulation, sums and agreement

Everything it needs is already in the run folder when the config step is done
(``config.yaml`` and the split files it names, ``train.parquet`` and ``validation.parquet``),
so `prepare` only checks there is something to train on.
"""

from __future__ import annotations

from pathlib import Path

from ...folder import (
    CHECKPOINTS,
    CONFIG,
    EXAMPLES,
    LOG,
    METRICS,
    PROFILE,
    SAMPLES,
    STOPPED,
    TRAIN_SPLIT,
    TRAINER_ERROR,
)
from ..protocol import STAGE_TRAIN, Artifacts, NoTrainingData


class Builtin:
    name = "builtin"

    def __init__(self, processes: int = 1, threads: int | None = None, nodes: int = 1,
                 rendezvous: str | None = None, run_id: str = "overbrainer", deterministic: bool = False,
                 device: str = "auto"):
        self.processes, self.threads = processes, threads
        self.device = device
        self.nodes, self.rendezvous, self.run_id = nodes, rendezvous, run_id
        self.deterministic = deterministic

    def prepare(self, run_dir: Path, root: str) -> None:
        examples = Path(run_dir) / TRAIN_SPLIT
        if not examples.is_file() or examples.stat().st_size == 0:
            raise NoTrainingData(Path(run_dir) / EXAMPLES)
        # a trainer that dies before it starts (killed while importing torch) must not have
        # an earlier attempt's line read as its own
        (Path(run_dir) / TRAINER_ERROR).unlink(missing_ok=True)

    def commands(self) -> list[list[str]]:
        # where it computes is the plan's, not config.yaml's (not an Axolotl setting)
        own = (["--device", self.device] if self.device != "auto" else []) + (["--deterministic"] if self.deterministic else [])
        loop = ["-m", "overbrainer.trainers.builtin", CONFIG, *own]
        if self.nodes > 1:
            # torch's own launcher on every machine, meeting at the rendezvous (c10d's store
            # runs on the machine whose address it names); node ranks are its to give
            return [["python", "-m", "torch.distributed.run", f"--nnodes={self.nodes}",
                     f"--nproc-per-node={self.processes}", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={self.rendezvous}", f"--rdzv-id={self.run_id}", *loop]]
        if self.processes > 1:
            # torch's own launcher: a rendezvous on this machine, N workers, restarts none
            return [["python", "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.processes}", *loop]]
        return [["python", *loop]]

    def env(self, root: str) -> dict[str, str]:
        env = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        if self.deterministic:
            # cuBLAS reads it at its first call: set before the trainer imports torch
            env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        return env

    def metrics_file(self) -> str:
        return METRICS

    def artifacts(self) -> Artifacts:
        return Artifacts(entries=[CHECKPOINTS, METRICS, SAMPLES, PROFILE, LOG, STOPPED, TRAINER_ERROR], exclude=[".tmp-*"],
                         required=CHECKPOINTS)

    def stop_marker(self) -> str | None:
        return STOPPED

    def stages(self) -> list[str]:
        return [STAGE_TRAIN]

    def metrics_required(self) -> bool:
        return True

    def caches_tools(self) -> bool:
        return False
