"""overbrainer's side of an Axolotl run: the plugin Axolotl loads, and two checks.

This file runs in the Axolotl environment (``trainers/axolotl_env.py``), never in
overbrainer's own, and imports nothing from overbrainer but this folder: ``Axolotl.prepare``
ships the folder into the run folder as ``axolotl-job/overbrainer_portable/``, the job's
``PYTHONPATH`` names ``axolotl-job``, and the job's command line names the plugin
(``--plugins=["overbrainer_portable.axolotl_plugin.OverbrainerPlugin", ...]``, Axolotl's
override of config.yaml's ``plugins``).

The plugin adds one Hugging Face ``TrainerCallback`` that makes an Axolotl run look, on
disk, like one of the built-in trainer's (``loop.py``):

- ``metrics.jsonl``: one line per optimizer step, ``{"step", "tokens", "loss", "lr",
  "eval_loss" (eval steps only), "seconds", "phase"}``; ``tokens`` counts the non-padding
  tokens trained on, ``seconds`` the time spent training (over every resume), ``phase``
  the schedule's (warmup, stable, decay: ``warmup_steps`` and
  ``lr_scheduler_kwargs.num_stable_steps``). A resume first drops the lines past the
  checkpoint it starts from; stage events stay.
- the cadence: validation loss when ``step % eval_steps == 0`` and at the last step,
  a checkpoint when ``step % save_steps == 0`` and at the last step.
- ``checkpoints/checkpoint-N/meta.json``, written after the Trainer saved the folder, its
  files fsynced first: a ``checkpoint-N`` with a ``meta.json`` is complete. The same
  sidecar as the built-in trainer's (step, steps, phase, decayed, loss, eval_loss, lr,
  tokens, seconds, fingerprint, adapter, base_model).
- a config key Axolotl does not know (Axolotl drops it without a word): refused as
  Axolotl loads the config, one line in ``trainer-error.txt``, exit 2.
- a stop: the file ``stop`` in the run folder (``overbrainer stop``), or SIGTERM/SIGINT,
  ends the run at the end of the current step with a checkpoint of it, writes
  ``stopped.json`` ``{"step", "steps"}``, and exits 0. Axolotl resumes from the newest
  ``checkpoint-N`` (``auto_resume_from_checkpoints``).

With several processes only rank 0 writes; the stop is decided on rank 0 and broadcast so
that every rank stops at the same step.

Run in the Axolotl environment (``python -I -c ...`` from ``portable.script``)::

    keys            Axolotl's config keys, as JSON: {"config": [...], "dataset": [...]}
    check CONFIG    CONFIG through Axolotl's own validate_config, and its keys against
                    Axolotl's (validate_config drops unknown keys without a word): one
                    line per problem, exit 2 when there is one
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from .common import (
    META,
    METRICS,
    STOP,
    STOPPED,
    TRAINER_ERROR,
    die_with_parent,
    fsync_tree,
    phase_of,
    truncate_metrics,
    write_atomic,
)

RUN_DIR_ENV = "OVERBRAINER_RUN_DIR"
FINGERPRINT_ENV = "OVERBRAINER_FINGERPRINT"
STOP_REQUEST, ERROR_FILE = STOP, TRAINER_ERROR


try:
    from axolotl.integrations.base import BasePlugin
except ImportError:  # overbrainer's own environment, which imports only the helpers above
    BasePlugin = None

if BasePlugin is not None:  # loaded by Axolotl: the plugin
    from transformers import TrainerCallback

    class OverbrainerPlugin(BasePlugin):
        """Metrics, checkpoint sidecars and the stop request, for overbrainer."""

        def register(self, cfg):
            if "LOCAL_RANK" in os.environ:
                die_with_parent()  # a worker of accelerate launch: dies with the launcher
            # Axolotl drops a key it does not know without a word: refuse it, in one line,
            # wherever the job runs (overbrainer checks before a job it runs itself too)
            unknown = unknown_keys(dict(cfg), keys())
            if unknown:
                message = (
                    f"{unknown[0]}: not an Axolotl setting, which Axolotl would ignore without a word; "
                    "remove it or fix its name" + (f" ({len(unknown) - 1} more)" if len(unknown) > 1 else "")
                )
                print(message, flush=True)
                if int(os.environ.get("RANK", "0")) == 0:
                    run_dir = Path(os.environ.get(RUN_DIR_ENV) or os.getcwd())
                    (run_dir / ERROR_FILE).write_text(message + "\n")
                raise SystemExit(2)

        def pre_model_load(self, cfg):
            # the plan's seed covers the LoRA initialization too, as in the built-in
            # trainer: Axolotl seeds only when it makes the Trainer, after the adapter
            from transformers import set_seed

            set_seed(int(cfg.seed or 0))

        def post_trainer_create(self, cfg, trainer):
            # count tokens as the built-in trainer does: those that are not padding
            trainer.args.include_num_input_tokens_seen = "non_padding"

        def create_lr_scheduler(self, cfg, trainer, optimizer, num_training_steps):
            # the schedule config.yaml names, exactly: Axolotl would stretch a one-step
            # warmup to two, shifting the whole warmup-stable-decay schedule by a step
            if cfg.lr_scheduler != "warmup_stable_decay":
                return None
            from transformers import get_wsd_schedule

            kwargs = dict(cfg.lr_scheduler_kwargs or {})
            return get_wsd_schedule(optimizer, num_warmup_steps=int(cfg.warmup_steps or 0), **kwargs)

        def add_callbacks_post_trainer(self, cfg, trainer):
            run_dir = Path(os.environ.get(RUN_DIR_ENV) or os.getcwd())
            return [RunCallback(cfg, run_dir)]

    class RunCallback(TrainerCallback):
        def __init__(self, cfg, run_dir: Path):
            self.run_dir = run_dir
            self.metrics = run_dir / METRICS
            self.stop_request = run_dir / STOP_REQUEST
            self.stopped_marker = run_dir / STOPPED
            self.checkpoints = Path(cfg.output_dir)
            if not self.checkpoints.is_absolute():
                self.checkpoints = Path.cwd() / self.checkpoints
            self.max_steps = int(cfg.max_steps)
            self.warmup = int(cfg.warmup_steps or 0)
            self.stable = int((cfg.lr_scheduler_kwargs or {}).get("num_stable_steps", self.max_steps))
            self.save_every = int(cfg.save_steps or self.max_steps)
            self.eval_every = int(cfg.eval_steps or self.max_steps)
            self.validating = bool(cfg.test_datasets) or bool(cfg.val_set_size)
            self.adapter = cfg.adapter or "full"
            self.base_model = str(cfg.base_model)
            self.fingerprint = os.environ.get(FINGERPRINT_ENV, "")
            self.started = time.monotonic()
            self.pending: dict | None = None
            self.last = {"loss": None, "eval_loss": None, "lr": None}
            self.evaluate_now = False
            self.stopping = False
            self.world_size = int(os.environ.get("WORLD_SIZE", "1"))

        # -- the run's start: where we resume from ------------------------------------

        def on_train_begin(self, args, state, control, **kwargs):
            seconds = 0.0
            if state.global_step:
                meta_path = self.checkpoints / f"checkpoint-{state.global_step}" / META
                try:
                    meta = json.loads(meta_path.read_text())
                    seconds = float(meta.get("seconds") or 0.0)
                    self.last = {k: meta.get(k) for k in ("loss", "eval_loss", "lr")}
                except (OSError, ValueError):
                    pass
                print(f"resuming from checkpoint-{state.global_step} (step {state.global_step} of {self.max_steps})", flush=True)
            self.started = time.monotonic() - seconds
            if state.is_world_process_zero:
                truncate_metrics(self.metrics, state.global_step)
                self.stopped_marker.unlink(missing_ok=True)
            # a signal asks for a stop, as `overbrainer stop` does (this replaces Axolotl's
            # SIGINT handler, which saves into output_dir and exits 0 without a checkpoint)
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, self._ask_stop)

        def _ask_stop(self, signum, frame):
            self.stop_request.write_text(f"signal {signum}\n")

        # -- each step: what comes after it -----------------------------------------

        def on_step_end(self, args, state, control, **kwargs):
            step = state.global_step
            last = step >= self.max_steps
            self.evaluate_now = step % self.eval_every == 0 or last
            control.should_log = True
            control.should_evaluate = self.evaluate_now and self.validating
            control.should_save = step % self.save_every == 0 or last
            if not last and self._stop_asked():
                self.stopping = True
                control.should_save = True
                control.should_training_stop = True
            return control

        def _stop_asked(self) -> bool:
            asked = self.stop_request.exists()
            if self.world_size > 1:
                import torch
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    flag = torch.tensor([1 if asked else 0], dtype=torch.int64)
                    if dist.get_backend() == "nccl":
                        flag = flag.cuda()
                    dist.broadcast(flag, src=0)  # rank 0's view, so every rank stops together
                    asked = bool(flag.item())
            return asked

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "loss" not in logs or "eval_loss" in logs:
                return  # an evaluation's or the run's summary
            step = state.global_step
            self.pending = {
                "step": step,
                "tokens": int(getattr(state, "num_input_tokens_seen", 0) or 0),
                "loss": round(float(logs["loss"]), 6),
                "lr": float(logs.get("learning_rate", 0.0)),
            }
            self.last.update(loss=self.pending["loss"], lr=self.pending["lr"])
            if not self.evaluate_now:
                self._flush(state)
            elif not self.validating:
                self.pending["eval_loss"] = None
                self.last["eval_loss"] = None
                self._flush(state)

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            if self.pending is None or self.pending["step"] != state.global_step:
                return
            loss = (metrics or {}).get("eval_loss")
            self.pending["eval_loss"] = round(float(loss), 6) if loss is not None else None
            self.last["eval_loss"] = self.pending["eval_loss"]
            self._flush(state)

        def _flush(self, state) -> None:
            line, self.pending = self.pending, None
            seconds = time.monotonic() - self.started
            line.update(seconds=round(seconds, 3), phase=phase_of(line["step"] - 1, self.warmup, self.stable))
            if not state.is_world_process_zero:
                return
            with open(self.metrics, "a") as f:
                f.write(json.dumps(line) + "\n")
            ev = f" eval {line['eval_loss']:.4f}" if line.get("eval_loss") is not None else ""
            print(
                f"step {line['step']}/{self.max_steps} loss {line['loss']:.4f}{ev} lr {line['lr']:.3g} "
                f"{line['tokens'] / max(seconds, 1e-9):.0f} tok/s",
                flush=True,
            )

        # -- a checkpoint was saved: its sidecar, last --------------------------------

        def on_save(self, args, state, control, **kwargs):
            if not state.is_world_process_zero:
                return
            if self.pending is not None:  # a save without a log line (never expected)
                self._flush(state)
            step = state.global_step
            folder = self.checkpoints / f"checkpoint-{step}"
            if not folder.is_dir():
                return
            phase = phase_of(step - 1, self.warmup, self.stable) if step else "warmup"
            meta = {
                "step": step,
                "steps": self.max_steps,
                "phase": phase,
                # a checkpoint before the decay is not annealed: compare such ones with
                # each other, not with the final model
                "decayed": phase == "decay" or step == self.max_steps,
                "loss": self.last["loss"],
                "eval_loss": self.last["eval_loss"],
                "lr": self.last["lr"],
                "tokens": int(getattr(state, "num_input_tokens_seen", 0) or 0),
                "seconds": round(time.monotonic() - self.started, 3),
                "fingerprint": self.fingerprint,
                "adapter": self.adapter,
                "base_model": self.base_model,
                "world_size": self.world_size,
                "trainer": "axolotl",
            }
            fsync_tree(folder)
            write_atomic(folder / META, json.dumps(meta, indent=1))

        def on_train_end(self, args, state, control, **kwargs):
            if self.stopping and state.is_world_process_zero:
                step = state.global_step
                write_atomic(self.stopped_marker, json.dumps({"step": step, "steps": self.max_steps}))
                print(f"stopped at step {step} on request", flush=True)


# -- run as a script: checks in the Axolotl environment -----------------------------------


def keys() -> dict[str, list[str]]:
    from axolotl.utils.schemas.config import AxolotlInputConfig
    from axolotl.utils.schemas.datasets import SFTDataset

    return {"config": _field_names(AxolotlInputConfig), "dataset": _field_names(SFTDataset)}


def _field_names(model) -> list[str]:
    names = set()
    for name, field in model.model_fields.items():
        names.add(name)
        if isinstance(field.alias, str):
            names.add(field.alias)
    return sorted(names)


def unknown_keys(cfg: dict, known: dict[str, list[str]]) -> list[str]:
    """Keys of `cfg` (top level, and of each datasets / test_datasets entry) Axolotl does
    not know."""
    top, dataset = set(known["config"]), set(known["dataset"])
    out = [k for k in cfg if k not in top]
    for group in ("datasets", "test_datasets"):
        for i, entry in enumerate(cfg.get(group) or []):
            if isinstance(entry, dict):
                out += [f"{group}[{i}].{k}" for k in entry if k not in dataset]
    return out


def check(config: Path) -> list[str]:
    """Problems with `config`, one line each: unknown keys, then Axolotl's own validation."""
    import yaml
    from axolotl.cli.config import gpu_capabilities, prepare_plugins
    from axolotl.utils.config import validate_config
    from axolotl.utils.dict import DictDefault

    # the config names this very file as its plugin, in the folder as it is shipped: make
    # it importable under that name too
    sys.modules.setdefault("overbrainer_portable", sys.modules[__package__])
    sys.modules.setdefault("overbrainer_portable.axolotl_plugin", sys.modules[__name__])
    cfg = yaml.safe_load(config.read_text())
    unknown = unknown_keys(cfg, keys())
    problems = [f"{config}: {k}: not an Axolotl setting (Axolotl would ignore it)" for k in unknown]
    for key in unknown:  # the rest goes through Axolotl's validation (the plugin would stop at these)
        *group, name = key.replace("[", ".").replace("]", "").split(".")
        (cfg[group[0]][int(group[1])] if group else cfg).pop(name)
    ddict = DictDefault(cfg)
    try:
        prepare_plugins(ddict)
        capabilities, env_capabilities = gpu_capabilities()
        validate_config(ddict, capabilities=capabilities, env_capabilities=env_capabilities)
    except Exception as e:  # pydantic's ValidationError, or Axolotl's ValueError
        text = " ".join(str(e).split())
        problems.append(f"{config}: Axolotl refuses it: {text[:500]}")
    return problems


def main(argv: list[str]) -> int:
    if argv[:1] == ["keys"] and len(argv) == 1:
        print(json.dumps(keys()))
        return 0
    if argv[:1] == ["check"] and len(argv) == 2:
        problems = check(Path(argv[1]))
        for line in problems:
            print(line)
        return 2 if problems else 0
    print("usage: keys | check CONFIG", file=sys.stderr)
    return 2
