"""``chat``: talk to a run's baked model or one of its checkpoints."""

from __future__ import annotations

import sys

from .common import find_run


def add_parsers(sub) -> None:
    p = sub.add_parser("chat", help="talk to a run's baked model, or to one of its checkpoints")
    p.add_argument("run")
    p.add_argument("prompt", nargs="?", help="one message; without it, a conversation on the terminal")
    p.add_argument("--checkpoint", type=int, metavar="STEP", help="a checkpoint's step instead of the baked model")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    p.set_defaults(func=cmd_chat)


def cmd_chat(args) -> int:
    from ..chat import Model

    run = find_run(args.run, args.runs)
    folder = run.folder.root
    model = Model.checkpoint(folder, args.checkpoint) if args.checkpoint is not None else Model.baked(folder)
    if not model.decayed:
        print(f"(step {model.step} is from before the decay: not annealed, not the final model)", file=sys.stderr)
    options = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.prompt:
        print(model.chat(args.prompt, **options))
        return 0
    messages: list[dict] = []
    print("type a message; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            text = input("you> ").strip()
        except EOFError:
            return 0
        if not text:
            return 0
        messages.append({"role": "user", "content": text})
        answer = model.chat(messages, **options)
        messages.append({"role": "assistant", "content": answer})
        print(answer)
