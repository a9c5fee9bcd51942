"""The built-in trainer's loss is the model's own: every family's output layer as its
forward computes it (scaled, soft-capped), over the positions that have a label."""

from __future__ import annotations

import pytest
import torch
from tiny import FAMILIES

from overbrainer.trainers.builtin.model import Decoder, TokenLoss, logit_transform

SHAPE = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0)


def tiny(config_class: str, model_class: str, **settings):
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**SHAPE, **settings}))
    with torch.no_grad():  # a trained model's scale: logits far enough apart to cap
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.3)
    return model.eval()


def losses(model, loss: TokenLoss | None = None) -> tuple[float, float]:
    """(transformers' own loss, the built-in trainer's), both per label token."""
    torch.manual_seed(0)
    ids = torch.randint(3, 300, (2, 24))
    labels = ids.clone()
    labels[:, :10] = -100  # a prompt without loss, as a conversation's user turn
    labels[1, 20:] = -100
    with torch.no_grad():
        own = model(input_ids=ids, labels=labels).loss.item()
        ours = Decoder(model, loss)(ids, None, labels).item() / int((labels[:, 1:] != -100).sum())
    return own, ours


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_tiny_family_trains_on_its_own_loss(family):
    config_class, model_class, extra = FAMILIES[family][:3]
    model = tiny(config_class, model_class, **{k: v for k, v in extra.items() if k != "pad_token_id"})
    own, ours = losses(model)
    assert ours == pytest.approx(own, rel=1e-5)
    assert TokenLoss(**logit_transform(model)).matches_the_model(model)  # the trainer's own check says so too


@pytest.mark.parametrize("name, settings, transform", [
    pytest.param("Gemma2", {"final_logit_softcapping": 2.0, "head_dim": 8, "query_pre_attn_scalar": 8},
                 {"scale": 1.0, "softcap": 2.0}, id="gemma2-softcap"),
    pytest.param("Cohere", {"logit_scale": 3.0}, {"scale": 3.0, "softcap": None}, id="cohere-logit_scale"),
    pytest.param("Granite", {"logits_scaling": 0.25}, {"scale": 4.0, "softcap": None}, id="granite-logits_scaling"),
    pytest.param("HyperCLOVAX", {"logits_scaling": 0.25}, {"scale": 0.25, "softcap": None}, id="hyperclovax-multiplies"),
])
def test_scaled_and_capped_logits_are_the_models_own(name, settings, transform):
    """Each family's transform, strong enough that leaving it out changes the loss."""
    model = tiny(f"{name}Config", f"{name}ForCausalLM", **settings)
    assert logit_transform(model) == transform
    own, ours = losses(model)
    assert ours == pytest.approx(own, rel=1e-5)
    _, plain = losses(model, TokenLoss())  # the output layer as it is: another loss
    assert abs(plain - own) > 1e-2 * own


def test_logits_the_trainer_does_not_know_are_taken_from_the_model():
    """A family whose forward does something of its own to the logits (here: divides them, as
    Inkling's width multiplier does): the start-of-run check finds the output layer is not
    the model's, and the loss is then taken from the model's own logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class Divided(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits / 24
            return out

    torch.manual_seed(0)
    model = Divided(LlamaConfig(**SHAPE)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.3)
    assert not TokenLoss(**logit_transform(model)).matches_the_model(model)
    torch.manual_seed(0)
    ids = torch.randint(3, 300, (2, 24))
    labels = ids.clone()
    labels[:, :10] = -100
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
        targets = labels[:, 1:]
        own = torch.nn.functional.cross_entropy(logits[targets != -100], targets[targets != -100], reduction="sum")
        ours = Decoder(model, TokenLoss(whole=True))(ids, None, labels)
        plain = Decoder(model, TokenLoss())(ids, None, labels)
    assert ours.item() == pytest.approx(own.item(), rel=1e-6)
    assert abs(plain.item() - own.item()) > 0.01 * own.item()
