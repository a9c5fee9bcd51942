"""``python -m overbrainer.trainers.builtin RUN_DIR/config.yaml``: the built-in trainer's process."""

from .loop import _exit_now, main

_exit_now(main())
