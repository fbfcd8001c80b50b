"""``python -m agent.cli``: the ``trackside`` command."""

from agent.cli.main import main

raise SystemExit(main())
