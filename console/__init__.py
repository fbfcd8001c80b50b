"""The operator console (Textual): live agents or a replayed store, a plain state model, screens as modes.

Run it with ``python -m console console|demo ...`` (``trackside console`` and ``trackside demo`` hand over to
it). The package imports no engine: the demo runs its simulated agent as a child process.
"""
