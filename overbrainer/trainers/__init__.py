"""Trainers: the Trainer protocol and its implementations (built-in, Axolotl)."""

from __future__ import annotations

from .protocol import Artifacts, NoTrainingData, Trainer

__all__ = ["Artifacts", "NoTrainingData", "Trainer", "get_trainer"]


def get_trainer(name: str, processes: int = 1, **builtin) -> Trainer:
    """The trainer `name`; `builtin` are the built-in trainer's own settings (nodes,
    rendezvous, run_id, deterministic)."""
    if name == "builtin":
        from .builtin import Builtin

        return Builtin(processes=processes, **builtin)
    if name == "axolotl":
        from .axolotl import Axolotl

        return Axolotl(processes=processes)
    raise KeyError(name)
