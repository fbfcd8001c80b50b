"""``python -m console console|demo ...``: the console's command line (see :mod:`console.cli`)."""

import sys

from console.cli import main

sys.exit(main())
