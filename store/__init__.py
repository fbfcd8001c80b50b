"""The store: DuckDB schema with a version (``schema``), the batched writer (``writer``), the recorder that
``trackside record`` and a recording console share (``recorder``), canned queries, SQL and Parquet export
(``queries``), a replay source (``replay``) and the ``sql``/``export`` subcommands (``cli``).

DuckDB is the only third-party database code here; from ``agent`` only ``agent.telemetry`` is imported: the
protocol, and its client (the recorder follows agents with it).
"""
