"""What runs where overbrainer is not installed: one folder, shipped whole.

=====================  ==============================================================
``runner.py``          a job folder's runner: every bundle's and remote job's ``run.py``
``axolotl_plugin.py``  the plugin Axolotl loads (metrics, checkpoint sidecars, the stop)
``common.py``          the helpers all of them share with the rest of the package: the
                       one copy of each (``now``, ``write_atomic``, ``run_commands``, ...)
``faults.py``          the fault points where the reliability tests kill a process
=====================  ==============================================================

Nothing here imports the rest of overbrainer, nor anything but the standard library at
module level (``tests/test_layers.py`` holds it to that). `ship` copies the folder into a
job folder as the package ``overbrainer_portable/``; a job's ``run.py`` is the few lines of
`launcher`, and Axolotl loads ``overbrainer_portable.axolotl_plugin``. Inside the package
the modules import each other relatively, so they are the same code under either name.
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["FOLDER", "SHIPPED", "ship", "launcher", "script"]

FOLDER = Path(__file__).resolve().parent
SHIPPED = "overbrainer_portable"  # the package's name where it is shipped


def ship(into: Path) -> Path:
    """Copy this folder into `into` as ``overbrainer_portable/`` (replacing one there)."""
    dest = Path(into) / SHIPPED
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for source in sorted(FOLDER.glob("*.py")):
        shutil.copyfile(source, dest / source.name)
    return dest


def launcher(module: str, doc: str) -> str:
    """A script that runs ``overbrainer_portable.<module>.main()`` from the package shipped
    beside it: a job folder's ``run.py``."""
    return f'''#!/usr/bin/env python3
"""{doc}"""
import sys
from pathlib import Path

HOME = Path(__file__).resolve().parent
sys.path.insert(0, str(HOME))
from {SHIPPED}.{module} import main  # noqa: E402

sys.exit(main(home=HOME))
'''


def script(module: str, *args: str) -> list[str]:
    """Arguments for ``python -I`` that run ``<module>.main(argv)`` from this very folder,
    in another Python environment (Axolotl's), nothing of its working folder on sys.path."""
    code = (f"import sys; sys.path.insert(0, {str(FOLDER.parent)!r}); "
            f"from {FOLDER.name}.{module} import main; sys.exit(main(sys.argv[1:]))")
    return ["-I", "-c", code, *args]
