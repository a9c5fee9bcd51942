"""The model the built-in trainer trains: loaded, adapted, placed, and its loss.

``load_model`` builds it as config.yaml says: the base from its folder (in 4-bit NF4 for
QLoRA), LoRA on top, on the training device, with gradient checkpointing, compiled
decoder layers and Liger's kernels when asked. ``token_loss`` is the summed cross-entropy
the loop normalizes.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

from ...inputs.base_cache import quiet_transformers
from ..examples import IGNORE, tokenizer_settings
from . import cpu_token_loss


def load_model(cfg: dict, device: torch.device, bf16: bool, sharded: bool = False,
               computes_on: torch.device | None = None):
    """(model, tokenizer): the model on `device`, its trained parameters in float32.
    `sharded` (FSDP2's to place): every weight in float32, as FSDP2 wants a layer's
    weights in one dtype; its mixed-precision policy gathers them in bf16. `computes_on`:
    where it will train, when that is not where it is loaded (sharded, it is loaded in host
    memory and FSDP2 moves each rank's slices to the GPU): the CPU's attention is for a
    model that computes on the CPU. Decoder layers are compiled where `torch_compile` is
    true, not "auto": that is the trainer's to settle for the device first."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    computes = computes_on or device
    base = cfg["base_model"]
    tokenizer = AutoTokenizer.from_pretrained(base)
    for key, value in tokenizer_settings(cfg).items():
        setattr(tokenizer, key, value)
    adapter = cfg.get("adapter")
    # a LoRA's base is frozen: in bf16 it is read as it is (no cast per step, half the
    # memory); the adapter and its optimizer stay float32, as every trained weight does
    dtype = torch.bfloat16 if bf16 and adapter and not sharded else torch.float32
    extra = {}
    if adapter == "qlora":
        from transformers import BitsAndBytesConfig

        # the quantized matmuls compute in bf16 where the device has it (QLoRA's recipe)
        compute_dtype = torch.bfloat16 if bf16 or device.type == "cpu" else torch.float32
        extra = dict(
            quantization_config=BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
                bnb_4bit_use_double_quant=True,
            ),
            device_map={"": device},
        )
        dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(
        base, dtype=dtype, attn_implementation="sdpa", trust_remote_code=bool(cfg.get("trust_remote_code")),
        **extra
    )
    if computes.type == "cpu" and bf16:
        from . import cpu_attention

        if cpu_attention.use(model):  # sdpa's forward, a faster bf16 backward for the CPU
            cpu_attention.serves(model)  # its kernel built now (once a machine), not in the first step
    model.config.use_cache = False
    if adapter == "qlora":
        from peft import prepare_model_for_kbit_training

        # freezes the base and keeps its norms, embeddings and output layer in float32;
        # checkpointing is ours to turn on (below), as for any other adapter
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        _keep_cpu_layout(model)
    elif device.type != "cpu":
        model.to(device)
    if cfg.get("liger_fused_linear_cross_entropy") or cfg.get("liger_rms_norm"):
        apply_liger(model, cfg)
    if cfg.get("gradient_checkpointing"):
        enable_checkpointing(model)
    if adapter:
        from peft import LoraConfig, get_peft_model

        settings = LoraConfig(
            r=cfg["lora_r"],
            lora_alpha=cfg["lora_alpha"],
            lora_dropout=cfg["lora_dropout"],
            target_modules=cfg["lora_target_modules"],
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, settings)
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    if cfg.get("torch_compile") is True:
        # on the CPU the compiled code calls its kernels from C++, not from a Python wrapper:
        # 1.6-7.8 % faster (median 4.5 %, 5 paired runs) on a bf16 LoRA step of SmolLM2-135M
        # on 2 cores (bench/README section 4)
        options = {"cpp_wrapper": True} if computes.type == "cpu" else None
        # each decoder layer in place (its state_dict keys unchanged: checkpoints load as
        # ever); lengths vary from step to step, so shapes are dynamic from the start
        for layer in decoder_layers(model):
            layer.compile(dynamic=True, options=options)
    return model, tokenizer


def eager():
    """Compiled layers run as plain modules inside it (torch 2.6 and later; before, as they are)."""
    return torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") else nullcontext()


def decoder_layers(model) -> list[torch.nn.Module]:
    return list(transformers_model(model).get_decoder().layers)


def enable_checkpointing(model) -> None:
    """Recompute each layer's activations in the backward (non-reentrant: right with a
    frozen base, DDP and compiled layers). transformers 5.24 renamed the method."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    name = "activation_checkpointing_kwargs" if enable.__name__.startswith("activation") else "gradient_checkpointing_kwargs"
    enable(**{name: {"use_reentrant": False}})


def _keep_cpu_layout(model) -> None:
    """bitsandbytes repacks a 4-bit weight for its CPU kernel the first time it runs in
    eval mode, and its backward does not go through that layout: keep the trained one."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def apply_liger(model, cfg: dict) -> None:
    """Liger Kernel's RMSNorm, RoPE and SwiGLU, patched into this model's modules (the
    fused linear cross-entropy is `token_loss`'s: it never materializes the logits)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(
        model=model, rope=bool(cfg.get("liger_rope")), rms_norm=bool(cfg.get("liger_rms_norm")),
        swiglu=bool(cfg.get("liger_glu_activation")), cross_entropy=False, fused_linear_cross_entropy=False,
    )


class TokenLoss:
    """The summed cross-entropy over the positions that have a label.

    The output layer runs only where loss is taken: with assistant-only loss that is a
    fraction of the positions, and the vocabulary projection is the largest matmul of a
    small model. With Liger (`fused`), the projection and the loss are one kernel over
    chunks, and the logits are never held at all; in bf16 on a CPU with AMX, a frozen output
    layer's are one C++ kernel (`cpu_token_loss`) likewise, compiled or not.

    With right padding and a causal mask, a real token never attends to a pad (pads come
    after it), so the attention mask is dropped (`mask=False`, on every device): exact on
    every position that has a label, and sdpa takes its flash kernel, which takes no mask
    (on 2 CPU cores, SmolLM2-135M in bf16: 3-8 % less time a step, the same losses).

    The logits are those the model's own forward computes: scaled and soft-capped as its
    family does (`logit_transform`), which `matches_the_model` checks at the start of every
    run; a model whose forward does something else to them (`whole`) has its loss taken
    from its own forward's logits, at every position (slower, always right).
    """

    def __init__(self, fused: bool = False, mask: bool = False, scale: float = 1.0, softcap: float | None = None,
                 whole: bool = False, compiled: bool = False):
        self.fused, self.mask, self.scale, self.softcap, self.whole = fused and not whole, mask, scale, softcap, whole
        # compiled (with train.compile): the output layer's result cast, its log-softmax and
        # their backward in fewer passes over the logits (on 2 CPU cores, SmolLM2-135M in
        # bf16: ~10 % less time a step and 25 % less peak memory)
        self.compiled = compiled and not self.fused
        if self.compiled:
            self._compiled = torch.compile(self.plain, dynamic=True)
        if self.fused:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            self.flce = LigerFusedLinearCrossEntropyLoss(reduction="sum", accum_dtype=torch.float32, softcap=softcap)

    def __call__(self, decoder, inputs: dict) -> torch.Tensor:
        """`decoder`: a `Decoder`, or the DDP or FSDP2 module around one."""
        mask = inputs["attention_mask"] if self.mask else None
        return decoder(inputs["input_ids"], mask, inputs["labels"])

    def of(self, hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor) -> torch.Tensor:
        targets = labels[:, 1:]
        where = targets != IGNORE
        kept = hidden[:, :-1][where]
        if self.fused:
            # the weight in the hidden states' dtype (bf16 under autocast), as autocast would
            # cast it; a scale (no bias: `logit_transform`) goes onto the hidden states
            weight = head.weight if head.weight.dtype == kept.dtype else head.weight.to(kept.dtype)
            bias = head.bias if head.bias is None or head.bias.dtype == kept.dtype else head.bias.to(kept.dtype)
            return self.flce(weight, kept if self.scale == 1.0 else kept * self.scale, targets[where], bias)
        if cpu_token_loss.applies(kept, head, self.softcap):
            return cpu_token_loss.token_loss(kept, head.weight, targets[where], self.scale)
        return (self._compiled if self.compiled else self.plain)(kept, head, targets[where])

    def on_kernel(self, head: torch.nn.Module) -> bool:
        """Whether bf16 hidden states' loss goes to the CPU kernel (`cpu_token_loss`)."""
        return not self.fused and cpu_token_loss.serves(head, self.softcap)

    def plain(self, kept: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(head(kept)), targets, reduction="sum")

    def logits(self, raw: torch.Tensor) -> torch.Tensor:
        """The output layer's result as the model's forward turns it into logits, in float32
        (as Liger's fused loss computes them)."""
        logits = raw.float()
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def of_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """`whole`: the model's own logits at every position, the loss where there are labels."""
        targets = labels[:, 1:]
        where = targets != IGNORE
        return F.cross_entropy(logits[:, :-1][where].float(), targets[where], reduction="sum")

    def matches_the_model(self, model) -> bool:
        """Whether these logits are the model's own: a few tokens through the decoder and
        the output layer here, and through the model's forward (both in the weights' dtype;
        the transform's rounding in bf16 is all the tolerance allows)."""
        inner = transformers_model(model)
        head = inner.get_output_embeddings()
        weight = next(p for p in inner.parameters() if p.is_floating_point())
        ids = (torch.arange(8, device=weight.device) * 7 + 3).remainder(head.weight.shape[0]).unsqueeze(0)
        training = inner.training
        inner.eval()  # no dropout: the two forwards the same
        with torch.no_grad(), eager():  # compiled layers compile for training, not for this
            hidden = inner.get_decoder()(input_ids=ids).last_hidden_state
            ours = self.logits(head(hidden))
            theirs = inner(input_ids=ids).logits.float()
        inner.train(training)
        if ours.shape != theirs.shape:
            return False
        tolerance = 1e-4 if weight.dtype == torch.float32 else 2e-2
        return bool(torch.allclose(ours, theirs, rtol=tolerance, atol=tolerance * float(theirs.abs().max())))


def logit_transform(model) -> dict:
    """What the model's own forward does to the output layer's result before its loss, as
    `TokenLoss` arguments: Gemma 2 (and its kin) soft-cap the logits, Cohere multiplies them
    by `logit_scale`, Granite divides them by `logits_scaling`, Falcon-H1 multiplies them by
    `lm_head_multiplier`, HyperCLOVA X multiplies them by `logits_scaling`, RecurrentGemma
    caps them at `logits_soft_cap`. Without it the trainer would fit a model other than the
    one it saves (tests/test_loss.py checks every tiny family against the model's own loss;
    `TokenLoss.matches_the_model` checks the model at hand)."""
    inner = transformers_model(model)
    config = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
    scale = 1.0
    if getattr(inner, "logit_scale", None) is not None and not isinstance(inner.logit_scale, torch.nn.Parameter):
        scale *= float(inner.logit_scale)  # Cohere's CausalLM keeps config.logit_scale
    scaling = getattr(config, "logits_scaling", None)
    if scaling:  # Granite divides by it, HyperCLOVA X multiplies
        scale = scale * float(scaling) if str(config.model_type).startswith("hyperclovax") else scale / float(scaling)
    multiplier = getattr(getattr(inner, "model", None), "lm_head_multiplier", None)
    if multiplier is not None:
        scale *= float(multiplier)  # Falcon-H1
    softcap = getattr(config, "final_logit_softcapping", None) or getattr(config, "logits_soft_cap", None)
    return {"scale": scale, "softcap": float(softcap) if softcap else None}


def transformers_model(model):
    """The transformers model inside a PEFT model (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class Decoder(torch.nn.Module):
    """The model as the loop runs it: input ids and labels in, the summed loss out. The
    decoder runs to the last hidden states and the output layer (`head`) only where there
    are labels (`TokenLoss.of`). A module of its own, so that DDP and FSDP2 wrap exactly
    what the loop calls: the whole forward, the loss included, is inside their hooks."""

    def __init__(self, model, loss: TokenLoss | None = None):
        super().__init__()
        self.model = model  # the PEFT model or the plain one: what is saved and merged
        self.head = transformers_model(model).get_output_embeddings()
        self.token_loss = loss or TokenLoss(**logit_transform(model))

    def forward(self, input_ids=None, attention_mask=None, labels=None, generate: dict | None = None):
        """The summed loss; or, given `generate` (`generate()`'s arguments), the model's
        generation, run inside the wrapper's hooks: sharded, FSDP2 gathers the root's
        weights (embeddings, final norm, output layer) for it as for a training forward."""
        if generate is not None:
            return self.model.generate(**generate)
        if self.token_loss.whole:
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
            return self.token_loss.of_logits(logits, labels)
        decoder = transformers_model(self.model).get_decoder()
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.token_loss.of(hidden, self.head, labels)


def load_weights(model, folder: Path, cfg: dict) -> None:
    """Put a checkpoint's trained weights into the freshly built model, exactly."""
    if cfg.get("adapter"):
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights

        result = set_peft_model_state_dict(model, load_peft_weights(str(folder), device="cpu"))
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise RuntimeError(f"{folder}: adapter weights do not fit the model: {unexpected[:3]}")
    else:
        from safetensors.torch import load_file

        state = {}
        for f in sorted(folder.glob("*.safetensors")):
            state.update(load_file(f))
        model.load_state_dict(state, strict=False)
