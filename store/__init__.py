"""The store: DuckDB schema with a version (``schema``), the batched writer (``writer``), canned queries, SQL and
Parquet export (``queries``), a replay source (``replay``) and the ``sql``/``export`` subcommands (``cli``).

DuckDB is the only third-party database code here; from ``agent`` only the protocol is imported.
"""
