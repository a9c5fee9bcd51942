"""``python -m overbrainer.trainers.builtin RUN_DIR/config.yaml``: the built-in trainer's process."""

from .loop import exit_now, main

exit_now(main())
