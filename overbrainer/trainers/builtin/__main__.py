"""``python -m overbrainer.trainers.builtin RUN_DIR/config.yaml``: the built-in trainer's process."""

import sys

from .allocator import device_argument, restart_with_tcmalloc

# on the CPU, started again with tcmalloc preloaded where it is installed (before torch loads)
restart_with_tcmalloc(device_argument(sys.argv[1:]))

from .loop import exit_now, main  # noqa: E402

exit_now(main())
