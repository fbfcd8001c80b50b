# First of all: whether the compiled modules or their source run (see policies/_compiled.py and setup.py).
from policies import _compiled as _compiled
