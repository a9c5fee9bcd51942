"""Trackers: ``metrics.jsonl`` mirrored to TensorBoard, MLflow and W&B, from one place.

``metrics.jsonl`` stays the record. The bake process already follows it while the trainer
runs (``steps/train.py``), whichever trainer wrote it (the built-in loop, or Axolotl through
its metrics plugin) and wherever it trains; a `Mirror` is handed each new line there, so
the trainer processes import no tracker and the two trainers cannot drift apart.

What each tracker is given::

    every numeric field of a step line   (loss, lr, eval_loss, tokens, seconds), at its step
    the resolved plan                    TensorBoard: text "plan"; MLflow: params + plan.json;
                                         W&B: the run's config
    the train step's fingerprint         TensorBoard: text "fingerprint"; MLflow: tag
                                         ``overbrainer.fingerprint``; W&B: a tag
    checkpoints (weights + meta.json)    MLflow and W&B artifacts (TensorBoard has none)
    samples.jsonl's greedy answers       TensorBoard: text "samples"; MLflow: an artifact
                                         ``samples/step-NNNNNN.json``; W&B: a table "samples"

Where they write: TensorBoard under the run folder's ``tensorboard/``; MLflow to
``$MLFLOW_TRACKING_URI``, else a SQLite store in the run folder's ``mlruns/``; W&B wherever
its own environment says (``WANDB_MODE``, ``WANDB_PROJECT``, ``WANDB_API_KEY``), its files
under the run folder's ``wandb/``. Credentials come only from the environment, read by the
tracker's own package; nothing here writes them anywhere.

run.json keeps, under ``"trackers"``, what continues the same tracker runs on a resume::

    {"fingerprint": "<train fingerprint>", "step": 12, "samples": 10,
     "mlflow": {"run_id": "..."}, "wandb": {"run_id": "..."}}

``step`` is the last step mirrored (``samples``: the last step whose samples were): a resumed trainer rewrites the lines after its checkpoint
(``truncate_metrics``) with the same values (resume is exact), and those are not logged
twice. A new fingerprint (another learning rate) starts new tracker runs.

A tracker that fails (a disk full, a server gone) says one warning line and is dropped;
training goes on and ``metrics.jsonl`` is complete.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path

from .. import journal
from ..errors import OverbrainerError
from ..folder import META, RunFolder
from ..plan import TRACKERS

__all__ = ["TRACKERS", "TrackerMissing", "require", "Mirror", "mlflow_uri"]

# tracker -> (module to import, pip package that provides it)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow-skinny"),
            "wandb": ("wandb", "wandb")}
# what a checkpoint artifact holds: the weights and the sidecar, not the optimizer state
WEIGHTS = ("adapter_model.safetensors", "adapter_config.json", "model.safetensors", "config.json", META)


class TrackerMissing(OverbrainerError):
    """A tracker the plan reports to is not installed."""


def require(names: list[str]) -> None:
    """Raise TrackerMissing, in one line with the pip command, for trackers not installed."""
    missing = [n for n in names if importlib.util.find_spec(PACKAGES[n][0]) is None]
    if missing:
        pips = " ".join(PACKAGES[n][1] for n in missing)
        raise TrackerMissing(
            f"report_to: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed; "
            f"pip install {pips}  (or: pip install 'overbrainer[{','.join(missing)}]')"
        )


class Mirror:
    """The trackers one train step reports to, opened once and fed each new metrics line."""

    def __init__(self, names: list[str], folder: RunFolder, fingerprint: str, plan: dict,
                 say: Callable[[str], None]):
        self.folder, self.say = folder, say
        kept = journal.read(folder).get("trackers") or {}
        if kept.get("fingerprint") != fingerprint:
            kept = {"fingerprint": fingerprint, "step": 0}
        self.state = kept
        self.trackers: dict = {}
        for name in names:
            try:
                tracker = _KINDS[name](folder, fingerprint, plan, kept.get(name) or {}, kept["step"])
            except Exception as e:  # noqa: BLE001 - any tracker failure: warn, train on
                self._warn(name, e)
                continue
            self.trackers[name] = tracker
            self.state[name] = tracker.ids()
        self._save()

    def lines(self, lines: list[dict], samples: list[dict] = ()) -> None:
        """Log these metrics lines and samples.jsonl lines (stage events and steps already
        mirrored are left out; samples of a step not logged yet wait for it), in step order,
        a step's metrics before its samples: W&B takes steps only in increasing order."""
        new = [m for m in lines if isinstance(m.get("step"), int) and m["step"] > self.state["step"]]
        upto = new[-1]["step"] if new else self.state["step"]
        shots = [s for s in samples if self.state.get("samples", -1) < s["step"] <= upto]
        if not new and not shots:
            return
        events = sorted([(m["step"], 0, m) for m in new] + [(s["step"], 1, s) for s in shots],
                        key=lambda e: e[:2])
        for name, tracker in list(self.trackers.items()):
            run: list[dict] = []
            for _, kind, line in events:
                if kind == 0:
                    run.append(line)
                    continue
                if run:
                    self._call(name, tracker.log, run)
                    run = []
                if name in self.trackers:
                    self._call(name, tracker.samples, line["step"], line["samples"])
            if run and name in self.trackers:
                self._call(name, tracker.log, run)
        self.state["step"] = upto
        if shots:
            self.state["samples"] = shots[-1]["step"]
        self._save()

    def checkpoint(self, path: Path) -> None:
        """A finished checkpoint folder, as an artifact where the tracker keeps them."""
        for name, tracker in list(self.trackers.items()):
            self._call(name, tracker.checkpoint, path)

    def close(self, finished: bool) -> None:
        for name, tracker in list(self.trackers.items()):
            self._call(name, tracker.close, finished)
        self.trackers.clear()

    def _call(self, name: str, method, *args) -> None:
        try:
            method(*args)
        except Exception as e:  # noqa: BLE001 - any tracker failure: warn, train on
            self.trackers.pop(name, None)
            self._warn(name, e)

    def _warn(self, name: str, error: Exception) -> None:
        why = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        self.say(f"warning: {name} stopped mirroring ({type(error).__name__}: {why}); "
                 "training goes on, metrics.jsonl is complete")

    def _save(self) -> None:
        journal.update(self.folder, trackers=self.state)


def _scalars(line: dict) -> dict[str, float]:
    return {k: float(v) for k, v in line.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _samples_markdown(rows: list[dict]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    return "| prompt | answer |\n|---|---|\n" + "".join(f"| {cell(r['prompt'])} | {cell(r['answer'])} |\n" for r in rows)


def _files(path: Path) -> list[Path]:
    return [path / n for n in WEIGHTS if (path / n).is_file()]


class TensorBoard:
    """Event files in the run folder's ``tensorboard/`` (torch's SummaryWriter, as HF's
    Trainer writes them)."""

    def __init__(self, folder: RunFolder, fingerprint: str, plan: dict, ids: dict, after: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: should a bake have died between logging and recording its step, the
        # steps after `after` written by then are dropped from the view, not doubled
        self.writer = SummaryWriter(str(folder.tensorboard), purge_step=after + 1 if after else None)
        if not after:
            self.writer.add_text("plan", "```\n" + json.dumps(plan, indent=1) + "\n```", 0)
            self.writer.add_text("fingerprint", fingerprint, 0)

    def ids(self) -> dict:
        return {}

    def log(self, lines: list[dict]) -> None:
        for m in lines:
            for key, value in _scalars(m).items():
                self.writer.add_scalar(key, value, m["step"])
        self.writer.flush()

    def samples(self, step: int, rows: list[dict]) -> None:
        self.writer.add_text("samples", _samples_markdown(rows), step)
        self.writer.flush()

    def checkpoint(self, path: Path) -> None:
        pass  # TensorBoard keeps no artifacts

    def close(self, finished: bool) -> None:
        self.writer.close()


def mlflow_uri(folder: RunFolder) -> str:
    """Where a run's MLflow runs are: ``$MLFLOW_TRACKING_URI``, else ``mlruns/mlflow.db`` in
    its folder (artifacts in ``mlruns/artifacts/``)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{folder.mlruns / 'mlflow.db'}"


class MLflow:
    """An MLflow run: ``$MLFLOW_TRACKING_URI``, else a SQLite store in the run folder's ``mlruns/``;
    the experiment is ``$MLFLOW_EXPERIMENT_NAME``, else "overbrainer"."""

    def __init__(self, folder: RunFolder, fingerprint: str, plan: dict, ids: dict, after: int):
        from mlflow.tracking import MlflowClient

        own = not os.environ.get("MLFLOW_TRACKING_URI")
        if own:  # MLflow's own default store, a SQLite file, kept in the run folder
            folder.mlruns.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=mlflow_uri(folder))
        run_id = ids.get("run_id")
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "overbrainer"
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self.client.create_experiment(
                name, artifact_location=(folder.mlruns / "artifacts").as_uri() if own else None)
            run_id = self.client.create_run(experiment, run_name=folder.name,
                                            tags={"overbrainer.fingerprint": fingerprint}).info.run_id
            from mlflow.entities import Param

            params = [Param(k, str(v)[:6000]) for k, v in _flatten(plan).items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(run_id, params=params[i:i + 100])
            self.client.log_dict(run_id, plan, "plan.json")
        self.run_id = run_id

    def ids(self) -> dict:
        return {"run_id": self.run_id}

    def log(self, lines: list[dict]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, m["step"]) for m in lines for k, v in _scalars(m).items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def samples(self, step: int, rows: list[dict]) -> None:
        self.client.log_dict(self.run_id, {"step": step, "samples": rows}, f"samples/step-{step:06d}.json")

    def checkpoint(self, path: Path) -> None:
        for f in _files(path):
            self.client.log_artifact(self.run_id, str(f), f"checkpoints/{path.name}")

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "KILLED")


class WandB:
    """A W&B run, as its environment says (``WANDB_MODE=offline`` keeps it on disk); its
    files in the run folder's ``wandb/``."""

    def __init__(self, folder: RunFolder, fingerprint: str, plan: dict, ids: dict, after: int):
        import wandb

        self.wandb = wandb
        folder.root.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "overbrainer", name=folder.name,
            id=ids.get("run_id"), resume="allow", dir=str(folder.root), config=plan,
            tags=[f"fingerprint:{fingerprint[:50]}"], reinit="create_new",
        )

    def ids(self) -> dict:
        return {"run_id": self.run.id}

    def log(self, lines: list[dict]) -> None:
        for m in lines:
            self.run.log(_scalars(m), step=m["step"])

    def samples(self, step: int, rows: list[dict]) -> None:
        table = self.wandb.Table(columns=["step", "prompt", "answer"],
                                 data=[[step, r["prompt"], r["answer"]] for r in rows])
        self.run.log({"samples": table}, step=step)

    def checkpoint(self, path: Path) -> None:
        art = self.wandb.Artifact(f"{self.run.id}-{path.name}", type="model", metadata={"checkpoint": path.name})
        for f in _files(path):
            art.add_file(str(f))
        self.run.log_artifact(art)

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


_KINDS = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB}


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): json.dumps(value) if isinstance(value, list) else value}
