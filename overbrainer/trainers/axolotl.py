"""The Axolotl trainer: Axolotl 0.19.0, in an environment of its own, behind the Trainer protocol.

The run folder of an Axolotl run is the built-in trainer's, plus ``axolotl-job/``::

    config.yaml                 the config step's, in Axolotl's keys (both trainers read it)
    examples.parquet            the conversations of both splits, with a ``split`` column
    axolotl-job/                written by prepare() before every job, a resume's included
        config.yaml             what Axolotl reads: config.yaml with the datasets pointing
                                at the two files below, test_datasets, the plugin,
                                auto_resume_from_checkpoints, logging_steps: 1, the
                                save/eval strategies and dataset_prepared_path
        train.parquet           examples.parquet's train rows (id, messages)
        validation.parquet      its validation rows; absent when there are none (no eval)
        overbrainer_portable/   portable/ as shipped: the plugin (metrics, sidecars, the stop)
        prepared/<key>/         Axolotl's tokenized datasets, keyed by data and config
        merged/                 merge-lora's output; the merge step moves it to merged/
    checkpoints/checkpoint-N/   Hugging Face Trainer checkpoints (adapter, optimizer,
                                scheduler, RNG, trainer_state.json) and the plugin's
                                meta.json, written last: with it, the checkpoint is whole
    checkpoints/*               Axolotl's own files beside them: debug.log, the adapter's
                                config, the tokenizer, the final adapter, README.md
    metrics.jsonl stopped.json log.txt    as the built-in trainer writes them

Where the job runs here (``root`` is the run folder itself), it runs the Axolotl
environment's python (``tools.axolotl_env``, built on first use), named by its path: the
here target runs "python" as its own interpreter, and Axolotl's is another one. Staged to
run elsewhere (export, ssh: ``root`` is another path), the commands name "python", the
job's own interpreter, in which the target installs Axolotl; nothing is built here then.

1. train: ``python -m axolotl.cli.train axolotl-job/config.yaml`` (several processes, one
   per GPU: ``python -m accelerate.commands.launch --multi_gpu --num_processes N -m
   axolotl.cli.train ...``; Axolotl cannot train on several CPU processes);
   Axolotl resumes from the newest ``checkpoint-N`` by itself.
2. merge (LoRA only): ``python -m axolotl.cli.merge_lora axolotl-job/config.yaml
   --lora_model_dir=checkpoints/checkpoint-<steps> --output_dir=axolotl-job``, skipped
   after a stop. A full fine-tune's last checkpoint is a model already.

Before each job, prepare() removes what a killed job left half-made: a ``checkpoint-N``
without its meta.json (Axolotl would resume from it) and ``axolotl-job/merged/``. A config
key Axolotl does not know (it would drop it without a word) is refused in one line: by
prepare() when the job runs here, and by the plugin as Axolotl loads it, wherever it runs.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from ..errors import OverbrainerError
from ..folder import (
    AXOLOTL_JOB,
    CHECKPOINTS,
    CONFIG,
    EXAMPLES,
    LOG,
    MERGED,
    META,
    METRICS,
    STOPPED,
    TRAINER_ERROR,
)
from ..fsio import replace_folder, write_atomic
from ..portable import SHIPPED, ship
from .protocol import STAGE_MERGE, STAGE_TRAIN, Artifacts, NoTrainingData

JOB_DIR = AXOLOTL_JOB
JOB_CONFIG = f"{JOB_DIR}/config.yaml"
MERGED_DIR = f"{JOB_DIR}/merged"
PLUGIN_CLASS = f"{SHIPPED}.axolotl_plugin.OverbrainerPlugin"
ERROR_FILE = TRAINER_ERROR  # one line the plugin writes when it refuses the config


class AxolotlConfigError(OverbrainerError):
    """A config key Axolotl does not know: it would ignore it without a word."""


class Axolotl:
    name = "axolotl"

    def __init__(self, processes: int = 1, say: Callable[[str], None] | None = None):
        self.processes = processes
        self.say = say or _say
        self.max_steps: int | None = None
        self.lora = True
        self.here = True  # the job runs on this machine (prepare() says otherwise)

    # -- the job's files ------------------------------------------------------------------

    def prepare(self, run_dir: Path, root: str) -> None:
        from ..portable.axolotl_plugin import unknown_keys
        from . import axolotl_env as tools

        run_dir = Path(run_dir)
        self.here = Path(root) == run_dir.absolute()
        examples = run_dir / EXAMPLES
        if not examples.is_file() or examples.stat().st_size == 0:
            raise NoTrainingData(examples)
        cfg = yaml.safe_load((run_dir / CONFIG).read_text())
        self.max_steps = int(cfg["max_steps"])
        self.lora = cfg.get("adapter") in ("lora", "qlora")
        if self.here and self.processes > 1 and tools.nvidia_gpus() < self.processes:
            # Axolotl puts each process on its own GPU; on CPUs it trains in one process
            raise OverbrainerError(
                f"train.processes is {self.processes}, but the Axolotl trainer runs one process per GPU and this "
                f"machine has {tools.nvidia_gpus()}; set train.processes to at most that (1 on CPUs), or use the "
                "built-in trainer, which trains on several CPU processes"
            )

        job = run_dir / JOB_DIR
        job.mkdir(exist_ok=True)
        rows = _write_splits(examples, job)
        if not rows["train"]:
            raise NoTrainingData(examples)
        job_cfg = job_config(cfg, has_validation=rows["validation"] > 0, key=_data_key(examples, run_dir / CONFIG))
        unknown = []
        if self.here:
            env = tools.axolotl_env(say=self.say, log=run_dir / LOG)
            unknown = unknown_keys(job_cfg, tools.axolotl_keys(env))
        if unknown:
            raise AxolotlConfigError(
                f"{run_dir / CONFIG}: {unknown[0]}: not an Axolotl {tools.AXOLOTL_VERSION} setting, "
                "which Axolotl would ignore without a word; remove it or fix its name"
                + (f" ({len(unknown) - 1} more: {', '.join(unknown[1:4])})" if len(unknown) > 1 else "")
            )

        ship(job)
        write_atomic(job / CONFIG, "# written by overbrainer from ../config.yaml before each job\n"
                    + yaml.safe_dump(job_cfg, sort_keys=False))
        _remove_stale(run_dir, job, job_cfg["dataset_prepared_path"])
        for said in (STOPPED, ERROR_FILE):
            (run_dir / said).unlink(missing_ok=True)

    # -- how the job runs -----------------------------------------------------------------

    def commands(self) -> list[list[str]]:
        from . import axolotl_env as tools

        python = str(tools.axolotl_python()) if self.here else "python"
        if self.processes > 1:
            # one process per GPU (Axolotl's way); a DeepSpeed config in config.yaml is Axolotl's
            train = [python, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(self.processes),
                     "-m", "axolotl.cli.train", JOB_CONFIG]
        else:
            train = [python, "-m", "axolotl.cli.train", JOB_CONFIG]
        if not self.lora:
            return [train]
        if self.max_steps is None:
            raise RuntimeError("Axolotl.commands() names the final checkpoint: call prepare() first")
        merge = [python, "-m", "axolotl.cli.merge_lora", JOB_CONFIG,
                 f"--lora_model_dir=checkpoints/checkpoint-{self.max_steps}", f"--output_dir={JOB_DIR}"]
        return [train, merge]

    def env(self, root: str) -> dict[str, str]:
        import os

        from ..portable.axolotl_plugin import RUN_DIR_ENV
        from . import axolotl_env as tools

        env = {
            **tools.QUIET_ENV,
            "PYTHONPATH": f"{root}/{JOB_DIR}",
            RUN_DIR_ENV: root,
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_DISABLE_TELEMETRY": "1",
        }
        if self.here:  # what the environment's own tools find first (accelerate, for one)
            venv = tools.axolotl_python().parent.parent
            env.update(PATH=str(venv / "bin") + os.pathsep + os.environ.get("PATH", ""), VIRTUAL_ENV=str(venv))
        return env

    def metrics_file(self) -> str:
        return METRICS

    def artifacts(self) -> Artifacts:
        return Artifacts(entries=[CHECKPOINTS, METRICS, LOG, STOPPED, MERGED_DIR],
                         exclude=[".tmp-*", ".*.tmp"], required=CHECKPOINTS)

    def stop_marker(self) -> str | None:
        return STOPPED

    def stages(self) -> list[str]:
        return [STAGE_TRAIN, STAGE_MERGE] if self.lora else [STAGE_TRAIN]

    def metrics_required(self) -> bool:
        return True

    def caches_tools(self) -> bool:
        return True


def job_config(cfg: dict, has_validation: bool, key: str) -> dict:
    """The config Axolotl reads, from the run's config.yaml: each split from its own file
    (Axolotl cannot filter rows by a column), and what overbrainer needs of the run."""
    out = copy.deepcopy(cfg)
    dataset = {k: v for k, v in cfg["datasets"][0].items() if k not in ("path", "ds_type", "split")}
    out["datasets"] = [{"path": f"{JOB_DIR}/train.parquet", "ds_type": "parquet", **copy.deepcopy(dataset)}]
    out["val_set_size"] = 0.0
    if has_validation:
        out["test_datasets"] = [
            {"path": f"{JOB_DIR}/validation.parquet", "ds_type": "parquet", "split": "train", **copy.deepcopy(dataset)}
        ]
        out["eval_strategy"] = "steps"
    else:
        out.pop("test_datasets", None)
        out["eval_strategy"] = "no"  # eval_steps stays: the plugin logs eval_loss null then
    out.update(
        plugins=[PLUGIN_CLASS],
        output_dir=CHECKPOINTS,
        save_strategy="steps",
        logging_steps=1,
        auto_resume_from_checkpoints=True,
        dataset_prepared_path=f"{JOB_DIR}/prepared/{key}",
        save_safetensors=True,
        # as the built-in trainer does: a conversation longer than sequence_len is cut, not
        # dropped (Axolotl's default); one left with nothing to learn is dropped
        excess_length_strategy=cfg.get("excess_length_strategy", "truncate"),
    )
    # the built-in trainer's own keys, which Axolotl does not know
    for key in ("device", "deterministic", "shard"):
        out.pop(key, None)
    if out.get("liger_rms_norm"):
        out["plugins"] = [*out["plugins"], "axolotl.integrations.liger.LigerPlugin"]
    return out


def adopt_merged(run_dir: Path, checkpoint: Path, dest: Path, special_tokens: dict) -> bool:
    """Move merge-lora's output to `dest` when it is there, whole, and made from
    `checkpoint` (after it, by the job that wrote it); False when it is not.

    merge-lora copies the base's tokenizer and configs as they are: the end-of-turn and
    padding tokens config.yaml names are set on them first, as the built-in merge does."""
    from transformers import AutoTokenizer, GenerationConfig
    from transformers.utils import logging


    merged = Path(run_dir) / MERGED_DIR
    try:
        fresh = merged.stat().st_mtime_ns >= (checkpoint / META).stat().st_mtime_ns
    except OSError:
        return False
    whole = (merged / "config.json").is_file() and any(merged.glob("*.safetensors"))
    if not (fresh and whole):
        return False
    logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(merged)
    for key, value in special_tokens.items():
        setattr(tokenizer, key, value)
    tokenizer.save_pretrained(merged)
    config = json.loads((merged / "config.json").read_text())
    config.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    write_atomic(merged / "config.json", json.dumps(config, indent=2) + "\n")
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(merged)
    replace_folder(merged, dest)
    return True


def _write_splits(examples: Path, job: Path) -> dict[str, int]:
    """examples.parquet's rows of each split into their own file; the row counts."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(examples, columns=["id", "split", "messages"])
    rows = {}
    for split in ("train", "validation"):
        part = table.filter(pc.equal(table["split"], split)).select(["id", "messages"])
        rows[split] = part.num_rows
        path = job / f"{split}.parquet"
        if part.num_rows:
            tmp = path.with_name(f".{path.name}.tmp")
            pq.write_table(part, tmp)
            tmp.replace(path)
        else:
            path.unlink(missing_ok=True)
    return rows


def _data_key(*files: Path) -> str:
    """Axolotl keys its tokenized datasets by the config's paths, not by their content:
    the data and config's own hash keeps an edit from reusing stale ones."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


def _remove_stale(run_dir: Path, job: Path, prepared: str) -> None:
    """What a killed or older job left that must not be used."""
    checkpoints = run_dir / CHECKPOINTS
    if checkpoints.is_dir():
        for p in checkpoints.glob("checkpoint-*"):
            if p.is_dir() and not (p / META).is_file():
                shutil.rmtree(p, ignore_errors=True)  # half-written: Axolotl would resume from it
    shutil.rmtree(job / MERGED, ignore_errors=True)
    keep = (run_dir / prepared).name
    if (job / "prepared").is_dir():
        for p in (job / "prepared").iterdir():
            if p.name != keep:
                shutil.rmtree(p, ignore_errors=True)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
