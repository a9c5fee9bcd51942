"""Write the trainer's configuration, config.yaml, in Axolotl's own format.

It is the config Axolotl runs (``cd runs/<name> && axolotl train config.yaml``) and the one
the built-in trainer reads: every key in it is one Axolotl 0.19.0 keeps. Paths in it are
relative to the run folder (the trainer runs there), except ``base_model``. The two splits
are files of their own beside it, ``train.parquet`` (``datasets``) and ``validation.parquet``
(``test_datasets``), examples.parquet's rows in its order: Axolotl cannot filter rows by a
column. Where the built-in trainer computes (train.device, train.deterministic) is not an
Axolotl setting: the train step gives it on the trainer's command line.

Before anything trains, the chat template (the plan's ``chat_template``, else the base's) must
render every conversation of examples.parquet with its assistant turns found: a base with no
template, a template whose end-of-turn token the tokenizer lacks, or one that fails on a
conversation is one line here. A plan's template is written as Axolotl's ``chat_template:
jinja`` with ``chat_template_jinja``, which the built-in trainer, the merge and the bake read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import OverbrainerError
from ..folder import AXOLOTL_JOB, CHECKPOINTS, CONFIG, TRAIN_SPLIT, VALIDATION_SPLIT
from ..fsio import write_atomic
from ..hashing import hash_bytes
from ..inputs.templates import Template, end_of_turn, resolve_template
from ..stamps import outputs_digest
from . import Outputs, upstream

if TYPE_CHECKING:
    from ..plan import TrainSettings
    from .context import Bake

NAME = "config"
VERSION = 2
TARGETS = [CONFIG, TRAIN_SPLIT, VALIDATION_SPLIT]


def inputs(bake: Bake) -> dict:
    split, base = upstream(bake, "split"), upstream(bake, "base")
    return {
        "train": bake.plan.train.model_dump(mode="json"),
        "trust_remote_code": bake.plan.trust_remote_code,
        "examples": outputs_digest(split),
        "train_rows": split.summary["train"],
        "base": outputs_digest(base),
        "base_folder": base.summary["folder"],
        "chat_template": _template_pin(plan_template(bake)),
    }


def plan_template(bake: Bake) -> Template | None:
    value = bake.plan.chat_template
    return resolve_template(value, bake.plan_dir) if value else None


def _template_pin(template: Template | None) -> dict | None:
    return None if template is None else {"from": template.origin, "hash": hash_bytes(template.text.encode())}


def schedule_steps(train: TrainSettings, train_rows: int) -> dict:
    """Steps of the run and of each schedule phase (warmup, stable, decay).

    With ``train.budgets`` this is the trunk's: the shared warmup and stable phase up to the
    latest decay start a budget needs (b − decay(b)), no decay of its own, and a checkpoint
    at each budget's decay start (``save_at``); ``budgets`` gives each budget's own schedule,
    that of a single run of b steps."""
    schedule = train.schedule
    if train.budgets:
        warmup = schedule.warmup_of(max(train.budgets))
        budgets = {str(b): phases(b, warmup, schedule.decay_of(b)) for b in train.budgets}
        trunk = max(b - schedule.decay_of(b) for b in train.budgets)
        out = phases(trunk, warmup, 0)
        out.update(save_at=sorted({b - schedule.decay_of(b) for b in train.budgets}), budgets=budgets)
        return out
    per_step = train.micro_batch_size * train.gradient_accumulation_steps
    if train.steps is not None:
        steps = train.steps
    else:
        steps = max(1, math.ceil((train.epochs or 1.0) * train_rows / per_step))
    warmup = min(schedule.warmup_of(steps), steps)
    return phases(steps, warmup, min(schedule.decay_of(steps), steps - warmup))


def phases(steps: int, warmup: int, decay: int) -> dict:
    return {"max_steps": steps, "warmup": warmup, "stable": steps - warmup - decay, "decay": decay}


def special_tokens(base_folder: Path) -> dict:
    """End-of-turn and padding tokens, as the base model's tokenizer names them; a model
    without a pad token pads with its end-of-turn token (padding is never trained)."""
    try:
        tok = json.loads((base_folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tok = {}

    def name(value):
        return value.get("content") if isinstance(value, dict) else value

    eos, pad = name(tok.get("eos_token")), name(tok.get("pad_token"))
    out = {}
    if eos:
        out["eos_token"] = eos
    if pad or eos:
        out["pad_token"] = pad or eos
    return out


def build_config(train: TrainSettings, base_folder: str, steps: dict, tokens: dict, trust_remote_code: bool = False,
                 chat_template: str | None = None, has_validation: bool = True, data_key: str = "") -> dict:
    """config.yaml: what ``axolotl train config.yaml`` runs (in the run folder), every key
    one Axolotl 0.19.0 keeps, and what the built-in trainer reads."""
    lora = train.adapter in ("lora", "qlora")
    dataset = {
        "ds_type": "parquet",
        "type": "chat_template",
        "field_messages": "messages",
        "roles_to_train": ["assistant"],
        "train_on_eos": "turn",
    }
    cfg = {
        "base_model": base_folder,
        "trust_remote_code": trust_remote_code,
        "chat_template": "jinja" if chat_template else "tokenizer_default",
        "chat_template_jinja": chat_template,
        "special_tokens": tokens,
        # each split from its own file beside config.yaml (Axolotl cannot filter rows by a
        # column): train.parquet is trained on, validation.parquet evaluated on
        "datasets": [{"path": TRAIN_SPLIT, **dataset}],
        "test_datasets": [{"path": VALIDATION_SPLIT, "split": "train", **dataset}] if has_validation else None,
        "val_set_size": 0.0,
        "sequence_len": train.sequence_len,
        "sample_packing": False,
        "group_by_length": train.group_by_length,
        "adapter": train.adapter if lora else None,
        "load_in_4bit": True if train.adapter == "qlora" else None,
        "lora_r": train.lora_r if lora else None,
        "lora_alpha": train.lora_alpha if lora else None,
        "lora_dropout": train.lora_dropout if lora else None,
        "lora_target_modules": list(train.lora_target_modules) if lora else None,
        "micro_batch_size": train.micro_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "max_steps": steps["max_steps"],
        "optimizer": "adamw_torch",
        "learning_rate": train.learning_rate,
        "weight_decay": train.weight_decay,
        "max_grad_norm": train.max_grad_norm,
        "lr_scheduler": "warmup_stable_decay",
        "lr_scheduler_kwargs": {
            "num_stable_steps": steps["stable"],
            "num_decay_steps": steps["decay"],
            "warmup_type": "linear",
            "decay_type": "linear",
            "min_lr_ratio": 0.0,
        },
        "warmup_steps": steps["warmup"],
        "output_dir": CHECKPOINTS,
        "save_strategy": "steps",
        "save_steps": train.save_every,
        "save_safetensors": True,
        # no validation rows: no evaluation (Axolotl refuses eval_steps without an eval set)
        "eval_strategy": "steps" if has_validation else None,
        "eval_steps": train.eval_every if has_validation else None,
        "logging_steps": 1,
        # a job resumes from the newest checkpoint-N (Axolotl's; the built-in trainer always does)
        "auto_resume_from_checkpoints": True,
        # Axolotl keys its tokenized datasets by the config's paths, not their content: the
        # data's and the settings' hash keeps an edit from reusing stale ones
        "dataset_prepared_path": f"{AXOLOTL_JOB}/prepared/{data_key}" if data_key else None,
        # as the built-in trainer does: a conversation longer than sequence_len is cut, not
        # dropped (Axolotl's default); one left with nothing to learn is dropped
        "excess_length_strategy": "truncate",
        # the built-in trainer's own: checkpoints where branches decay from (train.budgets)
        "save_at": steps.get("save_at"),
        "seed": train.seed,
        "train_on_inputs": False,
        "bf16": train.bf16,
        "fp16": False,
        # fp32 matmuls in TF32 on a GPU that has it (10 bits of mantissa where fp32 is asked;
        # bf16 autocast has 7): what TRL and Axolotl users get on an Ampere or newer GPU
        # ("auto": Axolotl refuses true on a machine without one, a CPU among them)
        "tf32": "auto",
        "flash_attention": False,
        "sdp_attention": True,
        "gradient_checkpointing": train.gradient_checkpointing,
        # "auto" is the built-in trainer's own: Axolotl's means on wherever torch has compile
        # (2.5.1 and later; read in its 0.19 wheel)
        "torch_compile": train.compile if train.trainer == "builtin" or train.compile != "auto" else False,
        # Axolotl's names for Liger's kernels (its LigerPlugin); the built-in trainer reads them too
        "liger_rope": train.liger is True or None,
        "liger_rms_norm": train.liger is True or None,
        "liger_glu_activation": train.liger is True or None,
        "liger_fused_linear_cross_entropy": train.liger is True or None,
        "plugins": ["axolotl.integrations.liger.LigerPlugin"] if train.liger is True else None,
        # the built-in trainer's own: with no Liger key, it turns them on where they were
        # measured to help ("auto", the default); false says never. (Axolotl has no "auto":
        # for it, as for a CPU, "auto" is off.)
        "liger": False if train.liger is False and train.trainer == "builtin" else None,
        # the built-in trainer's own: FSDP2 (train.shard; refused with Axolotl)
        "shard": train.shard or None,
        # the built-in trainer's own: a micro-batch's length rounded up to a multiple of it
        # (absent: "auto", which the trainer decides on the machine it runs on)
        "pad_to_multiple_of": train.pad_to_multiple_of if train.pad_to_multiple_of != "auto" else None,
        # the built-in trainer's own: torch.profiler over train.profile's steps (profile/)
        "profile": train.profile.model_dump() if train.profile else None,
    }
    return {k: v for k, v in cfg.items() if v is not None}


def write_splits(examples: Path, run_dir: Path) -> dict[str, int]:
    """examples.parquet's rows of each split into a file of its own beside config.yaml
    (train.parquet, validation.parquet; the rows in examples.parquet's order, the latter
    empty when there are none); the row counts."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(examples, columns=["id", "split", "messages"])
    rows = {}
    for split, name in (("train", TRAIN_SPLIT), ("validation", VALIDATION_SPLIT)):
        part = table.filter(pc.equal(table["split"], split)).select(["id", "messages"])
        rows[split] = part.num_rows
        path = run_dir / name
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(part, tmp)
        tmp.replace(path)
    return rows


def size(train: TrainSettings, base_folder: Path):
    """The memory estimate for this plan on this machine, with the micro-batch that fits."""
    from ..inputs.sizing import fit, model_shape

    return fit(
        model_shape(base_folder),
        lora=train.adapter in ("lora", "qlora"),
        qlora=train.adapter == "qlora",
        bf16=train.bf16,
        gradient_checkpointing=train.gradient_checkpointing,
        device_setting=train.device,
        processes=train.processes,
        shards=train.processes * train.nodes if train.shard else 1,
        lora_r=train.lora_r,
        targets=list(train.lora_target_modules),
        micro_batch_size=train.micro_batch_size,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        sequence_len=train.sequence_len,
        auto_on_cpu=train.trainer == "builtin",
    )


def check_gguf_template(formats: list[str], base_folder: Path, template: Template | None, say) -> None:
    """The GGUF formats' check of the template the merged model will carry (the plan's, else
    the base's): formats.check_gguf_template."""
    from ..formats.llama_cpp import check_gguf_template
    from ..formats.ollama import model_template

    text, special_tokens = model_template(base_folder)
    origin = "the base model's chat template"
    if template is not None:
        text, origin = template.text, f"the plan's chat_template ({template.origin})"
    check_gguf_template(formats, text, special_tokens, origin, say)


def check_chat_template(examples: Path, base_folder: Path, template: Template | None,
                        tokens: dict, max_len: int | None = None) -> tuple[dict, dict[str, int]]:
    """The special tokens to train with, and the train tokens of each source file (each
    conversation counted up to `max_len`, what trains of it), once the
    template (``template``, else the base's) rendered every conversation with its assistant
    turns found; OverbrainerError (one line) otherwise."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer
    from transformers.utils import logging

    from ..trainers.examples import assistant_spans, within

    logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(base_folder)
    for key, value in tokens.items():
        setattr(tokenizer, key, value)
    fix = ("set \"chat_template\" in the plan to chatml, llama3, mistral, gemma or phi3 (one whose tokens the "
           "base's tokenizer has) or to a Jinja file")
    if template is not None:
        tokenizer.chat_template = template.text
        eot = end_of_turn(template, tokenizer)
        if eot is None or eot not in tokenizer.get_vocab():
            raise OverbrainerError(
                f"config: chat_template {template.origin} ends a turn with {eot!r}, which the base model's tokenizer "
                f"does not have; use a template whose end-of-turn token it has (its eos is "
                f"{tokenizer.eos_token!r}), e.g. a Jinja file"
            )
        had_pad = tokenizer.pad_token is not None and tokens.get("pad_token") != tokens.get("eos_token")
        tokens = {"eos_token": eot, "pad_token": tokenizer.pad_token if had_pad else eot}
        tokenizer.eos_token = eot
    elif not tokenizer.chat_template:
        raise OverbrainerError(f"config: the base model {base_folder.name} has no chat template; {fix}")
    origin = template.origin if template is not None else "of the base model"
    counts: dict[str, int] = {}
    lengths: dict[str, int] = {}
    number = 0
    batches = pq.ParquetFile(examples).iter_batches(columns=["id", "split", "messages", "source"])
    for batch in batches:
        for row in batch.to_pylist():
            number += 1
            if row["id"] not in lengths:  # a conversation a weight repeats is checked once
                try:
                    text, spans = assistant_spans(tokenizer, row["messages"])
                    if not spans:
                        raise ValueError("it finds no assistant turn")
                except Exception as e:  # jinja's errors, raise_exception's, TemplateError
                    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    raise OverbrainerError(
                        f"config: the chat template ({origin}) fails on {row['source']} (row {number} of "
                        f"examples.parquet): {reason}; fix the template or that conversation, or {fix}"
                    ) from None
                if max_len is not None:  # a 50 MB conversation is tokenized as far as it trains
                    text = within(tokenizer, text, max_len)
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                lengths[row["id"]] = len(ids) if max_len is None else min(len(ids), max_len)
            if row["split"] == "train":
                name = row["source"].rsplit(":", 1)[0]
                counts[name] = counts.get(name, 0) + lengths[row["id"]]
    return tokens, counts


THINK = "<think>"


def reasoning_warnings(examples: Path, data_files: list[Path], base_folder: Path) -> list[str]:
    """Warnings for reasoning the fine-tune would silently lose: `<think>` blocks in the
    answers that the base model's chat template drops, and `reasoning_content` /
    `reasoning` fields, which the split keeps out (it trains role and content)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    warnings = []
    fields = sum(p.read_bytes().count(b'"reasoning') for p in data_files if p.suffix != ".parquet")
    if fields:
        warnings.append(
            f"config: the data has {fields} reasoning fields (reasoning_content / reasoning), which are not "
            "trained on; put the reasoning in the assistant's content as <think>...</think> to train it"
        )
    messages = pq.read_table(examples, columns=["messages"]).column("messages")
    flat = pc.list_flatten(messages)
    contents, roles = pc.struct_field(flat, "content"), pc.struct_field(flat, "role")
    thinking = pc.sum(pc.and_(pc.equal(roles, "assistant"), pc.match_substring(contents, THINK))).as_py() or 0
    if thinking and not _template_keeps_thinking(base_folder):
        warnings.append(
            f"config: {thinking} assistant turns have <think> blocks and the base model's chat template drops "
            "them: the model would learn to answer without reasoning; use a base whose template keeps "
            "reasoning, or remove the <think> blocks from the data"
        )
    return warnings


def _template_keeps_thinking(base_folder: Path) -> bool:
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(base_folder)
    probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": f"{THINK}zqxprobe</think>a"}]
    try:
        return "zqxprobe" in tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # a template that cannot render this: nothing to tell
        return True


SAMPLE_PROMPTS = 4  # validation conversations whose prompts are sampled when the plan names none


def sample_settings(train: TrainSettings, examples: Path) -> dict | None:
    """config.yaml's ``samples`` (``trainers/samples.py``): the plan's prompts as conversations,
    else the first validation conversations up to their first assistant turn."""
    samples = train.samples
    if samples is None:
        return None
    if train.trainer != "builtin":
        raise OverbrainerError(
            f"config: train.samples is taken by the built-in trainer only, not by {train.trainer}; "
            'remove train.samples or set train.trainer to "builtin"'
        )
    prompts = [[{"role": "user", "content": p}] for p in samples.prompts]
    if not prompts:
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(examples).iter_batches(columns=["split", "messages"]):
            for row in batch.to_pylist():
                turns = row["messages"]
                first = next((i for i, m in enumerate(turns) if m["role"] == "assistant"), None)
                if row["split"] == "validation" and first:
                    prompts.append([{"role": m["role"], "content": m["content"]} for m in turns[:first]])
            if len(prompts) >= SAMPLE_PROMPTS:
                break
        prompts = prompts[:SAMPLE_PROMPTS]
        if not prompts:
            raise OverbrainerError(
                "config: train.samples has no prompts and there are no validation conversations to take them "
                'from; give train.samples.prompts (["..."]) or set split.validation above 0'
            )
    return {"every": samples.every, "max_new_tokens": samples.max_new_tokens, "prompts": prompts}


def run(bake: Bake, inputs: dict) -> Outputs:
    from ..formats import check_formats

    train = bake.plan.train
    samples = sample_settings(train, bake.folder.examples)  # a refusal before any slower check
    steps = schedule_steps(train, inputs["train_rows"])
    if train.profile and train.profile.last > steps["max_steps"]:
        raise OverbrainerError(
            f"config: train.profile records steps {train.profile.start}-{train.profile.last}, and this run has "
            f"{steps['max_steps']}; lower train.profile.start or train.profile.steps"
        )
    # what bake.formats asks must be possible for this model before anything trains
    # (the train step asks again: the formats may change while config stays done)
    check_formats(list(bake.plan.bake.formats), json.loads((Path(inputs["base_folder"]) / "config.json").read_text()),
                  train.adapter)
    template = plan_template(bake)
    tokens = special_tokens(Path(inputs["base_folder"]))
    tokens, counts = check_chat_template(bake.folder.examples, Path(inputs["base_folder"]), template, tokens,
                                         train.sequence_len)
    check_gguf_template(list(bake.plan.bake.formats), Path(inputs["base_folder"]), template, bake.say)
    total = sum(counts.values()) or 1
    bake.say("config: train tokens by source: " + ", ".join(
        f"{name} {n:,} ({100 * n / total:.0f}%)" for name, n in counts.items()))
    warnings = reasoning_warnings(bake.folder.examples, bake.data_paths, Path(inputs["base_folder"]))
    for warning in warnings:
        bake.say(f"warning: {warning}")
    base_folder = inputs["base_folder"]
    memory = size(train, Path(base_folder))
    if memory.micro_batch_size != train.micro_batch_size:
        bake.say(
            f"config: micro-batch {train.micro_batch_size} x {train.gradient_accumulation_steps} does not fit; "
            f"training {memory.micro_batch_size} x {memory.gradient_accumulation_steps} (same examples per step)"
        )
        train = train.model_copy(update={"micro_batch_size": memory.micro_batch_size,
                                         "gradient_accumulation_steps": memory.gradient_accumulation_steps})
    rows = write_splits(bake.folder.examples, bake.folder.root)
    settings = build_config(train, base_folder, steps, tokens, bake.plan.trust_remote_code,
                            template.text if template else None, has_validation=rows["validation"] > 0)
    key = hash_bytes(json.dumps([inputs["examples"], settings], sort_keys=True).encode())[:16]
    cfg = build_config(train, base_folder, steps, tokens, bake.plan.trust_remote_code,
                       template.text if template else None, has_validation=rows["validation"] > 0, data_key=key)
    if samples:
        cfg["samples"] = samples
    header = f"# written by overbrainer from {bake.shown(bake.plan_path)}; edits are overwritten\n"
    import yaml

    write_atomic(bake.folder.config, (header + yaml.safe_dump(cfg, sort_keys=False)).encode())
    # the config as data too: the train step's check reads it from this stamp, not the YAML
    return Outputs(TARGETS, summary={**steps, "memory": memory.as_dict(), "warnings": warnings, "config": cfg})
