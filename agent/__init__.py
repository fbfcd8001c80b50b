# Imported first so that policies/_compiled.py decides, before any compiled agent module loads, which code runs.
import policies as _policies  # noqa: F401
