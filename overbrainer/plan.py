"""The plan: what model to start from, what conversations to learn, how to train, what to make.

A plan is a JSON file. It is validated once, here, into typed settings; every default lives
in this module and nowhere else. Errors are all reported at once, each with the field's
path, the line of the plan file where it is, and a fix (a typo gets "did you mean ...").

Paths in a plan (``data``, a local ``base``) are relative to the plan file's folder.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import PlanError
from .folder import default_name

__all__ = ["Plan", "DataSource", "SlurmSettings", "SlurmTarget", "SplitSettings", "TrainSettings", "Schedule", "BakeSettings",
           "load_plan"]

# What `bake.formats` may name; overbrainer/formats/ writes them. The gguf-<type> formats are
# the types the `gguf` package quantizes to in pure Python, so no llama.cpp build is needed at
# bake time (tests/test_formats.py keeps this list equal to what gguf.quants offers).
BAKE_FORMATS = (
    "safetensors",
    "gguf-f32", "gguf-f16", "gguf-bf16", "gguf-q8_0", "gguf-q5_1", "gguf-q5_0", "gguf-q4_1",
    "gguf-q4_0", "gguf-mxfp4", "gguf-tq2_0", "gguf-tq1_0",
    "ollama",
    "adapter",
)
TRAINERS = ("builtin", "axolotl")
# What `report_to` may name; overbrainer/trackers/ mirrors metrics.jsonl to them.
TRACKERS = ("tensorboard", "mlflow", "wandb")
# what `data[].format` may name, and the keys `data[].fields` may rename (inputs/formats.py)
DATA_FORMATS = ("auto", "openai", "sharegpt", "prompt_completion", "alpaca")
DATA_FIELDS = (
    "messages", "conversations", "prompt", "completion", "system", "instruction", "input", "output",
    "role", "content", "from", "value",
)
# the chat templates `chat_template` may name (formats in steps/templates.py)
TEMPLATE_FAMILIES = ("chatml", "llama3", "mistral", "gemma", "phi3")


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SplitSettings(_Settings):
    """How conversations are split into train and validation."""

    validation: Annotated[float, Field(ge=0, lt=1)] | Annotated[int, Field(ge=0)] = Field(
        default=0.1,
        description="A fraction of the conversations (0.1), or a count of them (20).",
    )
    seed: int = Field(default=0, description="Mixed into each conversation's hash to pick the split.")

    @field_validator("validation", mode="before")
    @classmethod
    def _not_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("must be a fraction like 0.1 or a count like 20, not true/false")
        return value


class Schedule(_Settings):
    """A warmup-stable-decay learning-rate schedule, as fractions of the training steps."""

    warmup: float = Field(default=0.1, ge=0, le=1, description="Linear warmup from 0.")
    decay: float = Field(default=0.2, ge=0, le=1, description="Linear decay to 0 at the end.")

    @model_validator(mode="after")
    def _fits(self) -> Schedule:
        if self.warmup + self.decay > 1:
            raise ValueError(
                f"warmup + decay is {self.warmup + self.decay:g}, more than the whole run; "
                "make their sum at most 1"
            )
        return self


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
        "(on a CUDA GPU that has bf16; elsewhere float32: set true to use a CPU's AVX512-BF16 or AMX).",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute each layer's activations in the backward instead of keeping them: "
        "much less memory for about a third more compute.",
    )
    compile: bool = Field(
        default=False,
        description="torch.compile each decoder layer (the first steps wait for the compiler).",
    )
    liger: bool = Field(
        default=False,
        description="Liger Kernel's fused linear cross-entropy, RMSNorm, RoPE and SwiGLU (CUDA only; "
        "pip install liger-kernel).",
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
    learning_rate: float = Field(default=2e-4, gt=0, le=10)
    weight_decay: float = Field(default=0.0, ge=0, le=10)
    max_grad_norm: float = Field(default=1.0, gt=0)
    schedule: Schedule = Field(default_factory=Schedule)
    save_every: int = Field(default=50, gt=0, description="Steps between checkpoints.")
    eval_every: int = Field(default=50, gt=0, description="Steps between validation losses.")
    seed: int = 0
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
        return self

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


class BakeSettings(_Settings):
    """What to make from the merged model: each format names what it puts in baked/.

    ``safetensors`` the merged model (HF folder); ``gguf-<type>`` one ``<name>-<type>.gguf`` file
    for llama.cpp and friends; ``ollama`` a Modelfile for the first GGUF listed; ``adapter`` the
    LoRA adapter alone, in ``adapter/``.
    """

    formats: list[Literal[BAKE_FORMATS]] = Field(default_factory=lambda: ["safetensors"], min_length=1)

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
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"{shown}:{e.lineno}", [f"invalid JSON ({e.msg}, column {e.colno}); fix the syntax"]) from None
    except RecursionError:
        raise PlanError(shown, ["is nested too deeply to be a plan; a plan is a few levels deep"]) from None
    if not isinstance(data, dict):
        raise PlanError(shown, [f"must be a JSON object with name, base, data, ...; it is a {type(data).__name__}"])
    data.setdefault("name", default_name(path))
    try:
        return Plan.model_validate(data)
    except ValidationError as e:
        raise PlanError(shown, _problems(e, text, shown)) from None


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
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths.extend(_field_paths(annotation, f"{full}."))
    return paths


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
        message = "must be letters, digits, '.', '_' or '-' (it names the run folder)"
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
        if part.isdigit():  # the n-th item of a list of objects: the key's n-th occurrence on
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
