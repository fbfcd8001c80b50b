"""``python -m console console|demo ...``: the console's command line (see :mod:`console.cli`)."""

import gc
import sys

from console.cli import main

status = main()
# Everything is written and closed, the children told to stop: leave without collecting the whole heap once more at
# the interpreter's exit (0.3 to 0.7 s of a quit on a busy 2-core machine, docs/benchmarks.md).
gc.freeze()
sys.exit(status)
