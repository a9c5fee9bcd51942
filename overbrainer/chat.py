"""A baked model or a checkpoint, as something to load and talk to.

    model = Model.baked("runs/demo")          # runs/demo/baked
    model = Model.checkpoint("runs/demo", 18) # the base model + step 18's adapter
    model.chat([{"role": "user", "content": "Hello!"}])
    model.generate("Once upon a time")
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import RunStateError
from .folder import CONFIG, RunFolder

__all__ = ["Model"]


@dataclass
class Model:
    path: Path  # a HF model folder, or a checkpoint folder (adapter) when `base` is set
    base: Path | None = None
    step: int | None = None
    decayed: bool = True

    @classmethod
    def baked(cls, run: str | Path) -> Model:
        folder = RunFolder(Path(run))
        if not (folder.baked / "config.json").is_file():
            raise RunStateError(f"{folder.root}: no baked model yet; bake the plan first, or pick a checkpoint")
        return cls(folder.baked)

    @classmethod
    def checkpoint(cls, run: str | Path, step: int | None = None) -> Model:
        from .trainers import checkpoint as ckpt

        folder = RunFolder(Path(run))
        done = ckpt.complete(folder.checkpoints)
        if not done:
            raise RunStateError(f"{folder.root}: no checkpoint yet; wait for the first save_every steps")
        steps = {s: p for s, p in done}
        if step is None:
            step = done[-1][0]
        if step not in steps:
            raise RunStateError(
                f"{folder.root}: no checkpoint at step {step}; there are: {', '.join(map(str, steps))}"
            )
        try:
            meta = ckpt.read_meta(steps[step])
        except ckpt.DamagedMeta as e:
            raise RunStateError(f"{e}; bake again to set it aside and train it anew, or give another step") from None
        base = Path(meta["base_model"])
        if not base.is_absolute() or not base.is_dir():
            # trained elsewhere (export, ssh): the base is this run's own base model
            from .stamps import read_stamp

            stamp = read_stamp(folder.stamp("base"))
            if stamp is not None:
                base = Path(stamp.summary["folder"])
        return cls(steps[step], base=base if meta.get("adapter") in ("lora", "qlora") else None, step=step, decayed=meta.get("decayed", True))

    def __repr__(self) -> str:
        what = f"checkpoint step {self.step}" if self.step is not None else "model"
        note = "" if self.decayed else ", not decayed (a constant-phase checkpoint)"
        return f"<{what} at {self.path}{note}>"

    def load(self):
        """(model, tokenizer), in float32, on a CUDA GPU when torch sees one, else the CPU."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .inputs.base_cache import quiet_transformers

        quiet_transformers()
        if not hasattr(self, "_loaded"):
            if self.base is not None:
                from peft import PeftModel

                model = AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32)
                model = PeftModel.from_pretrained(model, self.path)
                tokenizer = AutoTokenizer.from_pretrained(self.base)
                self._fix_tokens(tokenizer)
            else:
                model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)
                tokenizer = AutoTokenizer.from_pretrained(self.path)
            model.eval()
            if torch.cuda.is_available():
                model.to("cuda")
            self._loaded = (model, tokenizer)
        return self._loaded

    def _fix_tokens(self, tokenizer) -> None:
        # a checkpoint's tokenizer is the base's, with the special tokens config.yaml set
        config = self.path.parent.parent / CONFIG
        if config.is_file():
            import yaml

            from .trainers.examples import tokenizer_settings

            for key, value in tokenizer_settings(yaml.safe_load(config.read_text())).items():
                setattr(tokenizer, key, value)

    def chat(self, messages: list[dict] | str, max_new_tokens: int = 128, temperature: float = 0.0) -> str:
        """The assistant's next turn. Greedy unless `temperature` > 0."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        from .trainers.samples import answer

        model, tokenizer = self.load()
        return answer(model, tokenizer, messages, max_new_tokens, temperature)

    def generate(self, prompt: str, max_new_tokens: int = 128, temperature: float = 0.0) -> str:
        """A plain continuation of `prompt`, without the chat template."""
        from .trainers.samples import complete

        model, tokenizer = self.load()
        return complete(model, tokenizer, dict(tokenizer(prompt, return_tensors="pt")), max_new_tokens, temperature)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())
