"""``python -m overbrainer.cli``: the command line (what a run's own process is started as)."""

import sys

from . import main

sys.exit(main())
