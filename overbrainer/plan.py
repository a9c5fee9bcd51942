"""The plan: what model to start from, what conversations to learn, how to train, what to make.

A plan is a JSON file. It is validated once, here, into typed settings; every default lives
in this module and nowhere else. Errors are all reported at once, each with the field's
path, the line of the plan file where it is, and a fix (a typo gets "did you mean ...").

Paths in a plan (``data``, a local ``base``) are relative to the plan file's folder.
"""

from __future__ import annotations

import difflib
import json
import json.scanner
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import PlanError
from .folder import default_name

__all__ = ["Plan", "DataSource", "SlurmSettings", "SlurmTarget", "SplitSettings", "TrainSettings", "Schedule", "SampleSettings", "ProfileSettings",
           "BakeSettings",
           "load_plan"]

# What `bake.formats` may name; overbrainer/formats/ writes them. The gguf-<type> formats are
# llama.cpp's file types: converted by its convert_hf_to_gguf.py, quantized by its
# llama_model_quantize (formats/llama_cpp.py); the K-quants are the ones people run.
BAKE_FORMATS = (
    "safetensors",
    "gguf-f32", "gguf-f16", "gguf-bf16", "gguf-q8_0", "gguf-q6_k", "gguf-q5_k_m", "gguf-q4_k_m",
    "gguf-q5_1", "gguf-q5_0", "gguf-q4_1", "gguf-q4_0", "gguf-mxfp4", "gguf-tq2_0", "gguf-tq1_0",
    "ollama",
    "adapter",
)
TRAINERS = ("builtin", "axolotl")
# What `report_to` may name; overbrainer/trackers/ mirrors metrics.jsonl to them.
TRACKERS = ("tensorboard", "mlflow", "wandb")
CLUSTER_STEPS = ("train", "merge", "bake")  # what where.slurm.steps may send to the cluster
# what `data[].format` may name, and the keys `data[].fields` may rename (inputs/formats.py)
DATA_FORMATS = ("auto", "openai", "sharegpt", "prompt_completion", "alpaca")
DATA_FIELDS = (
    "messages", "conversations", "prompt", "completion", "system", "instruction", "input", "output",
    "role", "content", "from", "value",
)
# the chat templates `chat_template` may name (formats in steps/templates.py)
TEMPLATE_FAMILIES = ("chatml", "llama3", "mistral", "gemma", "phi3")


class _Settings(BaseModel):
    # strict: true is not 1, "3" is not 3 (a plan is JSON, validated as JSON: 3 is still 3.0);
    # NaN and Infinity are not numbers a setting can take
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


# what torch.Generator, numpy and Python's random take as a seed, with room for the
# trainer's seed * 1_000_003 + epoch
MAX_SEED = 2**32 - 1


class SplitSettings(_Settings):
    """How conversations are split into train and validation."""

    validation: Annotated[float, Field(ge=0, lt=1)] | Annotated[int, Field(ge=0)] = Field(
        default=0.1,
        description="A fraction of the conversations (0.1), or a count of them (20).",
    )
    seed: int = Field(default=0, ge=0, le=MAX_SEED, description="Mixed into each conversation's hash to pick the split.")

    @field_validator("validation", mode="before")
    @classmethod
    def _not_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("must be a fraction like 0.1 or a count like 20, not true/false")
        return value


class Schedule(_Settings):
    """A warmup-stable-decay learning-rate schedule: its warmup and decay as fractions of the
    training steps, or as counts of steps (``warmup_steps``, ``decay_steps``: the same for any
    length, so that runs of different lengths share their stable phase)."""

    warmup: float = Field(default=0.1, ge=0, le=1, description="Linear warmup from 0.")
    decay: float = Field(default=0.2, ge=0, le=1, description="Linear decay to 0 at the end.")
    warmup_steps: int | None = Field(default=None, ge=0, le=10_000_000,
                                     description="The warmup in steps, instead of `warmup`.")
    decay_steps: int | None = Field(default=None, ge=0, le=10_000_000,
                                    description="The decay in steps, instead of `decay`.")

    @model_validator(mode="after")
    def _fits(self) -> Schedule:
        for count, fraction in (("warmup_steps", "warmup"), ("decay_steps", "decay")):
            if getattr(self, count) is not None and fraction in self.model_fields_set:
                raise ValueError(f"set either {fraction} or {count}, not both")
        if self.warmup + self.decay > 1:
            raise ValueError(
                f"warmup + decay is {self.warmup + self.decay:g}, more than the whole run; "
                "make their sum at most 1"
            )
        return self

    def warmup_of(self, steps: int) -> int:
        """The warmup, in steps, of a run of `steps` steps."""
        return self.warmup_steps if self.warmup_steps is not None else round(self.warmup * steps)

    def decay_of(self, steps: int) -> int:
        """The decay, in steps, of a run of `steps` steps."""
        return self.decay_steps if self.decay_steps is not None else round(self.decay * steps)


class SampleSettings(_Settings):
    """Greedy answers to a few prompts while training, in the run folder's samples.jsonl."""

    every: int = Field(default=50, gt=0, description="Steps between samples (also taken at step 0 and the last step).")
    prompts: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list, max_length=64,
        description="User messages to answer; empty: the prompts of the first validation conversations (up to 4).",
    )
    max_new_tokens: int = Field(default=64, gt=0, le=4096)


class ProfileSettings(_Settings):
    """torch.profiler over a few steps of the built-in trainer, its files in the run folder's profile/."""

    start: int = Field(
        default=2, gt=0, le=10_000_000,
        description="The first step recorded, counted as the log counts them (from 1); the step before it, "
        "when this process runs it, warms the profiler up.",
    )
    steps: int = Field(default=3, gt=0, le=100, description="How many steps are recorded.")
    memory: bool = Field(
        default=False,
        description="Record allocations too: memory columns in ops.txt and, on CUDA, memory.pickle "
        "(a snapshot for https://pytorch.org/memory_viz).",
    )

    @property
    def last(self) -> int:
        return self.start + self.steps - 1


class TrainSettings(_Settings):
    """How to train."""

    trainer: Literal["builtin", "axolotl"] = "builtin"
    adapter: Literal["lora", "qlora", "full"] = Field(
        default="lora",
        description='"lora"; "qlora" (the base in 4-bit NF4 with bitsandbytes, LoRA on top; merged/ is 16-bit); '
        'or "full" (every weight trained).',
    )
    lora_r: int = Field(default=16, gt=0, le=4096)
    lora_alpha: int = Field(default=32, gt=0, le=65536)
    lora_dropout: float = Field(default=0.0, ge=0, lt=1)
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )
    steps: int | None = Field(default=None, gt=0, le=10_000_000)
    budgets: list[Annotated[int, Field(gt=0, le=10_000_000)]] | None = Field(
        default=None, min_length=1,
        description="Several finished models from one run: one per budget (steps), each a decay branched "
        "off the shared stable phase (branches/<budget>/).",
    )
    epochs: float | None = Field(default=None, gt=0, le=100_000)
    micro_batch_size: int = Field(default=4, gt=0, le=65536)
    gradient_accumulation_steps: int = Field(default=1, gt=0, le=65536)
    sequence_len: int = Field(default=512, ge=8, le=1_048_576)
    device: Annotated[str, Field(pattern=r"^(auto|cpu|mps|cuda(:[0-9]+)?)$")] = Field(
        default="auto",
        description='Where the model trains: "auto" (CUDA when torch sees a GPU, then Apple mps, else the CPU), '
        '"cpu", "mps", "cuda" or "cuda:N". Under several processes each takes its own GPU: name "cuda".',
    )
    bf16: bool | Literal["auto"] = Field(
        default="auto",
        description='Compute in bfloat16 (the adapter and its optimizer stay float32): true, false, or "auto" '
        "(on a CUDA GPU that has bf16 and on a CPU with AMX; elsewhere float32: set true to use a CPU's AVX512-BF16).",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute each layer's activations in the backward instead of keeping them: "
        "much less memory for about a third more compute.",
    )
    compile: bool | Literal["auto"] = Field(
        default="auto",
        description='torch.compile each decoder layer (the first step waits for the compiler): true, false, or '
        '"auto" (on for a LoRA trained in bf16 on a CPU for 100 steps or more, where a C++ compiler is at hand: '
        "measured faster there; off elsewhere).",
    )
    liger: bool | Literal["auto"] = Field(
        default="auto",
        description="Liger Kernel's fused linear cross-entropy, RMSNorm, RoPE and SwiGLU (CUDA only; "
        'pip install liger-kernel): true, false, or "auto" (on where the built-in trainer computes on a CUDA GPU '
        "and liger_kernel imports, unsharded; measured faster and leaner there; off elsewhere).",
    )
    deterministic: bool = Field(
        default=False,
        description="torch.use_deterministic_algorithms (with CUBLAS_WORKSPACE_CONFIG): on CUDA, a resumed "
        "run equals an uninterrupted one bit for bit, at some speed.",
    )
    group_by_length: bool = Field(
        default=True,
        description="Train conversations of about one length together (each epoch still sees every one "
        "once): less padding, faster steps.",
    )
    pad_to_multiple_of: Annotated[int, Field(ge=1, le=4096)] | Literal["auto"] = Field(
        default="auto",
        description="Pad each micro-batch to a length that is a multiple of this (the built-in trainer's; "
        'Axolotl pads to a multiple of 64): 1 pads to the longest conversation alone; "auto" is 8 where bf16 '
        "matmuls run on a CPU (oneDNN prepares each new shape once, so fewer lengths cost less: measured faster "
        "there) and 1 elsewhere.",
    )
    learning_rate: float = Field(default=2e-4, gt=0, le=10)
    weight_decay: float = Field(default=0.0, ge=0, le=10)
    max_grad_norm: float = Field(default=1.0, gt=0)
    schedule: Schedule = Field(default_factory=Schedule)
    save_every: int = Field(default=50, gt=0, description="Steps between checkpoints.")
    eval_every: int = Field(default=50, gt=0, description="Steps between validation losses.")
    samples: SampleSettings | None = Field(
        default=None, description="Greedy answers to prompts at every `every` steps, in samples.jsonl and the trackers.",
    )
    profile: ProfileSettings | None = Field(
        default=None,
        description="Record where a few steps spend their time (torch.profiler): profile/ops.txt, a table "
        "of the operators; profile/trace.json.gz, a timeline for https://ui.perfetto.dev. true for the defaults.",
    )
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    processes: int = Field(
        default=1, ge=1, le=1024,
        description="Training processes on each machine (torchrun; DDP with gloo on CPU, NCCL on GPU: one per GPU).",
    )
    nodes: int = Field(
        default=1, ge=1, le=4096,
        description="Machines training together (torchrun's rendezvous at train.rendezvous); run the same bake on each.",
    )
    rendezvous: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]+:[0-9]{1,5}$")] | None = Field(
        default=None, description="HOST:PORT of torchrun's c10d rendezvous, reachable from every node (nodes > 1).",
    )
    shard: bool = Field(
        default=False,
        description="Shard the weights, gradients and optimizer state across the processes with FSDP2 "
        "(torch.distributed.fsdp.fully_shard), for a model whose training does not fit one GPU; "
        "checkpoints are gathered into the usual files, and resume under another number of processes.",
    )
    @model_validator(mode="after")
    def _one_length(self) -> TrainSettings:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("set either steps or epochs, not both")
        if self.budgets is not None and (self.steps is not None or self.epochs is not None):
            raise ValueError("set either budgets or steps/epochs, not both (each budget is a length)")
        if self.budgets is not None and self.trainer != "builtin":
            raise ValueError("train.budgets branches decays off the built-in trainer's checkpoints; "
                             "set train.trainer to builtin, or train one length with train.steps")
        if self.pad_to_multiple_of != "auto" and self.trainer != "builtin":
            raise ValueError("train.pad_to_multiple_of is the built-in trainer's (Axolotl pads to a multiple of 64 "
                             "itself); remove it, or set train.trainer to builtin")
        if self.profile is not None and self.trainer != "builtin":
            raise ValueError("train.profile records the built-in trainer's steps; remove it, or set train.trainer "
                             "to builtin (Axolotl has profiler_steps of its own)")
        if self.steps is not None:
            self._fits_in(self.steps, "train.steps")
        for budget in self.budgets or []:
            self._fits_in(budget, "train.budgets")
        return self

    def _fits_in(self, steps: int, field: str) -> None:
        schedule = self.schedule
        warmup = schedule.warmup_of(max(self.budgets) if self.budgets else steps)
        decay = schedule.decay_of(steps)
        if warmup + decay > steps:
            raise ValueError(f"{steps} steps ({field}) are fewer than the warmup ({warmup}) plus the decay ({decay}); "
                             f"make it at least {warmup + decay} or shorten the schedule")

    @field_validator("profile", mode="before")
    @classmethod
    def _profile_true(cls, value: Any) -> Any:
        # "profile": true takes the defaults; false is none
        if value is True:
            return {}
        return None if value is False else value

    @field_validator("budgets")
    @classmethod
    def _budgets_once_each(cls, budgets: list[int] | None) -> list[int] | None:
        if budgets is None:
            return None
        twice = sorted({b for b in budgets if budgets.count(b) > 1})
        if twice:
            raise ValueError(f"{', '.join(map(str, twice))} listed more than once; list each budget once")
        return sorted(budgets)

    @model_validator(mode="after")
    def _sharable(self) -> TrainSettings:
        world = self.processes * self.nodes
        if world > 1 and self.gradient_accumulation_steps % world:
            raise ValueError(
                f"gradient_accumulation_steps {self.gradient_accumulation_steps} cannot be shared equally by "
                f"{world} processes (each takes as many micro-batches of a step); make it a multiple of {world}"
            )
        if world > 1 and self.device.startswith("cuda:"):
            raise ValueError(f'device "{self.device}" names one GPU, and each of the {world} processes takes '
                             'its own; set device to "cuda"')
        if self.shard and world == 1:
            raise ValueError("shard splits the model across the training processes, and there is one; "
                             "set processes to 2 or more (one per GPU), or shard to false")
        if self.shard and self.adapter == "qlora":
            raise ValueError('shard does not take adapter "qlora" (FSDP2 cannot shard bitsandbytes\' 4-bit '
                             'weights); use adapter "lora" or "full" with shard, or qlora without it')
        if self.shard and self.trainer != "builtin":
            raise ValueError(f'shard is the built-in trainer\'s (trainer "{self.trainer}" has its own FSDP '
                             'settings); set trainer to "builtin", or shard to false')
        if self.nodes > 1 and self.rendezvous is None:
            raise ValueError(f"nodes is {self.nodes}: set rendezvous to HOST:PORT of one of them, e.g. node0:29400")
        return self


class PushSettings(_Settings):
    """Where ``overbrainer bake`` uploads ``baked/`` when it is done."""

    repo: Annotated[str, Field(pattern=r"^[\w.-]+/[\w.-]+$")] = Field(description="org/name on the Hub")
    private: bool = False
    revision: Annotated[str, Field(min_length=1)] | None = None


class BakeSettings(_Settings):
    """What to make from the merged model: each format names what it puts in baked/.

    ``safetensors`` the merged model (HF folder); ``gguf-<type>`` one ``<name>-<type>.gguf`` file
    for llama.cpp and friends; ``ollama`` a Modelfile for the first GGUF listed; ``adapter`` the
    LoRA adapter alone, in ``adapter/``.
    """

    formats: list[Literal[BAKE_FORMATS]] = Field(default_factory=lambda: ["safetensors"], min_length=1)
    license: Annotated[str, Field(pattern=r"^[\w.+-]+$")] | None = Field(
        default=None, description="The model card's licence (a Hub licence id: apache-2.0, mit, llama3.1, other); "
        "default: the base model's, where its card says it.")
    push: PushSettings | None = Field(
        default=None, description="After the bake, upload baked/ to this Hub repository (overbrainer push).")

    @field_validator("formats")
    @classmethod
    def _consistent(cls, formats: list[str]) -> list[str]:
        twice = sorted({f for f in formats if formats.count(f) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed more than once; list each format once")
        if "ollama" in formats and not any(f.startswith("gguf-") for f in formats):
            raise ValueError("ollama needs a GGUF file to run; add a gguf format too, e.g. gguf-q8_0")
        return formats


class DataSource(_Settings):
    """One source of conversations: a path (file, folder, glob) or a Hugging Face dataset id
    ``org/name[@revision][:config]``, and how it is read and mixed. A bare string is its path."""

    path: Annotated[str, Field(min_length=1)]
    weight: float | None = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="This source's share of the training examples (weights of all sources are compared).",
    )
    format: Literal[DATA_FORMATS] = Field(default="auto", description="The rows' format; auto detects it.")
    fields: dict[Literal[DATA_FIELDS], Annotated[str, Field(min_length=1)]] = Field(
        default_factory=dict, description='Column names the data uses: {"messages": "dialog", "role": "speaker"}.',
    )
    split: Annotated[str, Field(pattern=r"^[\w.-]+$")] = Field(
        default="train", description="The split of a hub dataset or a save_to_disk DatasetDict."
    )
    rows: int | None = Field(default=None, gt=0, description="At most this many conversations of it (sampled).")

    @model_validator(mode="before")
    @classmethod
    def _a_path(cls, value: Any) -> Any:
        return {"path": value} if isinstance(value, str) else value


class SSHTarget(_Settings):
    """Train on another machine over OpenSSH."""

    ssh: Annotated[str, Field(min_length=1, description="user@host (or a Host of ~/.ssh/config)")]
    workdir: str = Field(default="overbrainer", description="Where runs live there (relative to its home).")
    port: int | None = Field(default=None, ge=1, le=65535)
    identity: str | None = Field(default=None, description="A private key file for this host.")


class SlurmSettings(_Settings):
    """A Slurm batch job: each setting becomes one ``#SBATCH`` line of the run's job.sh."""

    partition: str | None = Field(default=None, min_length=1, description="--partition")
    nodes: int = Field(default=1, ge=1, le=4096, description="--nodes; torchrun meets on the first one")
    gpus_per_node: int | None = Field(default=None, ge=1, le=64, description="--gpus-per-node")
    cpus_per_task: int | None = Field(default=None, ge=1, le=4096, description="--cpus-per-task")
    time: str | None = Field(default=None, pattern=r"^[0-9:-]+$", description='--time, e.g. "12:00:00"')
    account: str | None = Field(default=None, min_length=1, description="--account")
    qos: str | None = Field(default=None, min_length=1, description="--qos")
    requeue: bool = Field(default=False, description="--requeue: Slurm may requeue the job (preemption)")
    grace: int = Field(default=120, ge=1, le=86400,
                       description="--signal=B:USR1@<grace>: seconds before its time limit the trainer checkpoints")
    sbatch: list[Annotated[str, Field(pattern=r"^--?[A-Za-z]")]] = Field(
        default_factory=list, description='More sbatch options, each one as written: ["--constraint=h100"]')
    workdir: str | None = Field(
        default=None, min_length=1,
        description="A folder the nodes see, for a run folder they do not: the job is staged there as an export "
                    "bundle's job folder (checked against its manifest) and its result brought back the same way")
    steps: list[Literal[CLUSTER_STEPS]] = Field(
        default_factory=lambda: ["train"],
        description='The steps that run as Slurm jobs: "train" always; add "merge" and "bake" to send them too '
                    "(default: they run where the bake runs, once the last checkpoint is on the shared filesystem)")


class SlurmTarget(_Settings):
    """Train as a Slurm batch job, the run folder on a filesystem the cluster shares."""

    slurm: SlurmSettings = Field(default_factory=SlurmSettings)


class Plan(_Settings):
    """A fine-tune, declared."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")]
    base: Annotated[str, Field(min_length=1)]
    data: Annotated[list[DataSource], Field(min_length=1)] = Field(
        description="A path, or a list of sources: paths or {path, weight, format, fields, split, rows}."
    )
    split: SplitSettings = Field(default_factory=SplitSettings)
    train: TrainSettings = Field(default_factory=TrainSettings)
    bake: BakeSettings = Field(default_factory=BakeSettings)
    trust_remote_code: bool = Field(
        default=False, description="Run Python code shipped with the base model (off: only safetensors and configs are read).",
    )
    where: Literal["here", "export"] | SSHTarget | SlurmTarget = Field(
        default="here",
        description='"here", "export" (a bundle to run anywhere), {"ssh": "user@host"} or {"slurm": {...}}.',
    )
    report_to: list[Literal[TRACKERS]] = Field(
        default_factory=list,
        description="Trackers that mirror metrics.jsonl while it trains: tensorboard, mlflow, wandb.",
    )

    @field_validator("report_to")
    @classmethod
    def _once_each(cls, names: list[str]) -> list[str]:
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed more than once; list each tracker once")
        return names
    chat_template: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description="The chat template to train with: a Jinja string, a .jinja file (relative to the plan), "
        f"or one of {', '.join(TEMPLATE_FAMILIES)}; default: the base model's own.",
    )

    @model_validator(mode="after")
    def _slurm_fits_the_trainer(self) -> Plan:
        if not isinstance(self.where, SlurmTarget):
            return self
        slurm = self.where.slurm
        if slurm.nodes > 1 and self.train.trainer != "builtin":
            raise ValueError("where.slurm.nodes > 1 runs torchrun across nodes: the built-in trainer only; "
                             "set train.trainer to builtin or nodes to 1")
        if slurm.gpus_per_node is not None and slurm.gpus_per_node != self.train.processes:
            raise ValueError(f"where.slurm.gpus_per_node is {slurm.gpus_per_node} but train.processes (training "
                             f"processes per node, one per GPU) is {self.train.processes}; make them equal")
        twice = sorted({s for s in slurm.steps if slurm.steps.count(s) > 1})
        if "train" not in slurm.steps or twice:
            raise ValueError(f"where.slurm.steps is {json.dumps(slurm.steps)}: the slurm target always trains on the "
                             'cluster; list "train", then "merge" and "bake" to send them too, each once')
        if slurm.workdir and len(slurm.steps) > 1:
            raise ValueError(f"where.slurm.steps sends {' and '.join(s for s in slurm.steps if s != 'train')} to the "
                             "cluster, which reads the run folder where it is, but where.slurm.workdir stages only "
                             'the training there; set steps to ["train"] (they run here) or unset workdir')
        return self

    @property
    def data_files(self) -> list[str]:
        return [s.path for s in self.data]

    @field_validator("data", mode="before")
    @classmethod
    def _a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("data")
    @classmethod
    def _weights_all_or_none(cls, data: list[DataSource]) -> list[DataSource]:
        weighted = [s.weight is not None for s in data]
        if any(weighted) and not all(weighted):
            missing = ", ".join(f"data[{i}]" for i, w in enumerate(weighted) if not w)
            raise ValueError(f"{missing} has no weight while others have one; give every source a weight, or none")
        return data


# ---------------------------------------------------------------------------------------
# Reading a plan file, and saying what is wrong with it


def load_plan(path: str | Path, raw: bytes | None = None) -> Plan:
    """Read and validate a plan file (its bytes `raw`, when already read). Raises
    PlanError with every problem found."""
    path = Path(path)
    shown = str(path)
    try:
        raw = path.read_bytes() if raw is None else raw
    except FileNotFoundError:
        raise PlanError(shown, ["no such plan file; check the path"]) from None
    except IsADirectoryError:
        raise PlanError(shown, ["is a folder, not a plan file; give the path of a .json plan"]) from None
    except OSError as e:
        raise PlanError(shown, [f"cannot read it ({e.strerror}); check its permissions"]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise PlanError(f"{shown}:{line}", ["is not UTF-8 text; save the plan as UTF-8"]) from None
    try:
        data = _Decoder().decode(text)
    except _DuplicateKey as e:
        raise PlanError(f"{shown}:{e.second}", [f"{e.key!r} is given twice in one object (lines {e.first} and "
                                                f"{e.second}); keep one"]) from None
    except json.JSONDecodeError as e:
        raise PlanError(f"{shown}:{e.lineno}", [f"invalid JSON ({e.msg}, column {e.colno}); fix the syntax"]) from None
    except RecursionError:
        raise PlanError(shown, ["is nested too deeply to be a plan; a plan is a few levels deep"]) from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", bool: "true or false", type(None): "null"}.get(type(data), "a number")
        raise PlanError(shown, [f"must be a JSON object with name, base, data, ...; it is {kind}"])
    data.setdefault("name", default_name(path))
    try:
        # validated as JSON, strictly: a setting's type as JSON writes it (no "3" for 3)
        return Plan.model_validate_json(json.dumps(data), strict=True)
    except ValidationError as e:
        raise PlanError(shown, _problems(e, text, shown)) from None


class _DuplicateKey(ValueError):
    def __init__(self, key: str, first: int, second: int):
        self.key, self.first, self.second = key, first, second
        super().__init__(key)


class _Decoder(json.JSONDecoder):
    """JSON that refuses a key given twice in one object (Python's json keeps the last one
    without a word), with the lines of both. It takes json's pure-Python scanner, whose
    objects it can watch being read: a plan is small."""

    def __init__(self):
        super().__init__()
        self.parse_object = self._object
        self.scan_once = json.scanner.py_make_scanner(self)

    @staticmethod
    def _object(s_and_end, strict, scan_once, object_hook, object_pairs_hook, memo=None, *rest):
        starts: list[int] = []

        def watched(string: str, index: int):  # called once per value of this object, where it starts
            starts.append(index)
            return scan_once(string, index)

        pairs, end = json.decoder.JSONObject(s_and_end, strict, watched, object_hook, lambda p: p, memo, *rest)
        text, seen = s_and_end[0], {}
        for (key, _), start in zip(pairs, starts):
            line = text.count("\n", 0, start) + 1
            if key in seen:
                raise _DuplicateKey(key, seen[key], line)
            seen[key] = line
        return dict(pairs), end


def _problems(error: ValidationError, text: str, shown: str) -> list[str]:
    # a union field (split.validation, data) fails once per member: say it once
    seen, problems = set(), []
    for err in error.errors():
        field = tuple(str(p) for p in err["loc"] if not _is_union_tag(p))
        if field not in seen:
            seen.add(field)
            problems.append(_describe(err, text, shown))
    return problems


def _field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for name, info in model.model_fields.items():
        full = f"{prefix}{name}"
        paths.append(full)
        annotation = info.annotation
        inner = [a for a in get_args(annotation) if a is not type(None)]
        if len(inner) == 1 and type(None) in get_args(annotation):  # X | None: X's fields
            annotation = inner[0]
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths.extend(_field_paths(annotation, f"{full}."))
    return paths


# the type errors of strict validation, in words: `true` is not 1, "3" is not 3
_STRICT_TYPES = {
    "int_type": "a whole number (write it without quotes or a decimal point)",
    "int_from_float": "a whole number (write it without a decimal point)",
    "float_type": "a number (write it without quotes)",
    "bool_type": "true or false (without quotes)",
    "string_type": "a string (in quotes)",
}

_FIXES = {
    "missing": "add it",
    "extra_forbidden": "remove it",
}


def _describe(err: dict, text: str, shown: str) -> str:
    loc = [str(p) for p in err["loc"] if not _is_union_tag(p)]
    # a key with a newline or another control character is shown quoted: one line per problem
    field = ".".join(part if part.isprintable() else json.dumps(part) for part in loc) or "(plan)"
    line = _line_of(text, loc)
    where = f"{shown}:{line}: " if line else f"{shown}: "
    kind = err["type"]
    if kind == "extra_forbidden":
        known = _field_paths(Plan)
        parent = ".".join(loc[:-1])
        siblings = [p.rsplit(".", 1)[-1] for p in known if p.rsplit(".", 1)[0] == parent and "." in p] if parent else [
            p for p in known if "." not in p
        ]
        guess = difflib.get_close_matches(loc[-1], siblings, n=1, cutoff=0.6)
        if not guess:
            # a setting put at the wrong level: "learning_rate" at the top is train.learning_rate
            leaf = [p for p in known if p.rsplit(".", 1)[-1] == loc[-1]]
            anywhere = leaf or difflib.get_close_matches(field, known, n=1, cutoff=0.75)
            if anywhere:
                return f"{where}{field}: unknown setting; did you mean {anywhere[0]}?"
            return f"{where}{field}: unknown setting; remove it (known here: {', '.join(siblings)})"
        suggestion = f"{parent}.{guess[0]}" if parent else guess[0]
        return f"{where}{field}: unknown setting; did you mean {suggestion}?"
    if kind == "missing":
        return f"{where}{field}: required; add it"
    message = err["msg"]
    for prefix, replacement in (("Value error, ", ""), ("Input should be", "should be")):
        if message.startswith(prefix):
            message = replacement + message[len(prefix):]
    if kind == "string_pattern_mismatch" and loc == ["name"]:
        given = str(err.get("input"))
        message = "must be letters, digits, '.', '_' or '-', at most 100 characters (it names the run folder)"
        if len(given) > 100:
            message = f"is {len(given)} characters; {message}"
    if kind == "finite_number":
        message = f"is {json.dumps(err.get('input'))}, not a finite number; give a number"
    if kind in _STRICT_TYPES and isinstance(err.get("input"), (bool, str, int, float)):
        given = json.dumps(err["input"], ensure_ascii=False)
        message = f"is {given if len(given) <= 40 else given[:37] + '...'}, not {_STRICT_TYPES[kind]}"
    if kind == "literal_error" and loc[:2] == ["bake", "formats"]:
        message = f"unknown format {err.get('input')!r}; supported: {', '.join(BAKE_FORMATS)}"
    if kind == "literal_error" and loc == ["train", "trainer"]:
        message = f"unknown trainer {err.get('input')!r}; supported: {', '.join(TRAINERS)}"
    if kind == "literal_error" and loc[:1] == ["report_to"]:
        given = str(err.get("input"))
        guess = difflib.get_close_matches(given.lower(), TRACKERS, n=1, cutoff=0.5)
        hint = f"did you mean {guess[0]!r}?" if guess else f"supported: {', '.join(TRACKERS)}"
        message = f"unknown tracker {given!r}; {hint}"
    fix = _FIXES.get(kind, "")
    return f"{where}{field}: {message}" + (f"; {fix}" if fix else "")


def _is_union_tag(part: Any) -> bool:
    # pydantic names the union member it tried ("float", "int", "list[...]"): not a field
    return isinstance(part, str) and (part in {"float", "int", "str"} or "[" in part or "constrained" in part)


def _line_of(text: str, loc: list[str]) -> int | None:
    """The line of the deepest key of `loc` found in the plan text, searching in order."""
    pos, found, skip = 0, None, 0
    for part in loc:
        if part.isdecimal():  # the n-th item of a list of objects: the key's n-th occurrence on
            skip = int(part)
            continue
        key = re.compile(r'"' + re.escape(part) + r'"\s*:')
        match = key.search(text, pos)
        for _ in range(skip):
            match = match and key.search(text, match.end())
        skip = 0
        if not match:
            break
        pos, found = match.end(), match.start()
    return text.count("\n", 0, found) + 1 if found is not None else None
