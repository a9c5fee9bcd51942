"""``python -m overbrainer``: the command line, as ``overbrainer``."""

import sys

from .cli import main

sys.exit(main())
