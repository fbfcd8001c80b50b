"""The console's plain state model and its pure functions: no Textual, no sockets, no database, no clock.

The feed workers fold events into :class:`~console.model.state.ConsoleState`; screens compute what they draw with
the pure queries here and pass it down to their widgets. import-linter and ``tests/test_import_hygiene.py`` check
that nothing here imports the UI, the store or a socket.

* :mod:`~console.model.state`: the state (folding events; time moves on by ``tick``).
* :mod:`~console.model.records`: the records it keeps and hands out (nodes, units, sources, alerts, summaries).
* :mod:`~console.model.series`, :mod:`~console.model.metrics`: time-bucketed series and the heatmap's metrics.
* :mod:`~console.model.queries`, :mod:`~console.model.fleet`, :mod:`~console.model.render`: window summaries,
  trends, heatmap grids, the Overview's rows, formatting and colour scales.
* :mod:`~console.model.placement`: units' GPUs and parallel sizes as labels (the Overview, the Heatmap).
* :mod:`~console.model.steps`, :mod:`~console.model.slack`, :mod:`~console.model.stages`,
  :mod:`~console.model.policy_view`: what the Steps, Slack, Stages and Policies screens show.
* :mod:`~console.model.playback`: the replay cursor (its clock injected).
"""
