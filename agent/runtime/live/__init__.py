"""The live runtime: units whose engines step on their own (vLLM's engine cores, or
:class:`~agent.engine.sim_live.SimLiveUnit` in wall time), behind one dispatcher, served as the agent's node.

``cluster`` (the request path: dispatch, streams, migration by recompute, failed units), ``node`` (the cluster as a
served node: telemetry hooks and control), ``restarts``, ``requests``, ``cluster_driver``. It imports no vLLM
(``tests/test_import_hygiene.py``): the engines are :class:`~agent.engine.live.LiveEngine` s. It was
``agent.runtime.vllm`` until 2026-11-27.
"""
