"""Batch and dispatch policies on the simulated node: what only a whole node run shows (refusals counted,
nothing lost, CascadeInfer's hand-overs). The policies' own behaviour is tested in ``tests/policies``."""

from __future__ import annotations

import collections

import numpy as np
from node_builders import H100_LIKE, make_unit, requests, run_node

from agent.runtime.node import Node
from policies.dispatch.cascade import CascadeInfer


def test_node_counts_refused_requests_and_loses_nothing() -> None:
    unit = make_unit(0, "fairbatching+pab", cost=H100_LIKE, max_num_batched_tokens=8192, max_num_seqs=256)
    # 40 long prompts at once: the first take the budget, the rest are refused; none vanish.
    reqs = requests([(6000, 20)] * 40)
    node, _, done = run_node([unit], reqs, ttft_slo_s=0.5, tpot_slo_s=0.05)
    assert node.num_refused > 0
    assert node.num_rejected == node.num_refused
    assert len(done) + node.num_rejected == 40
    assert not node.unfinished()
    refused = [s for s in node.states.values() if s.rejected]
    assert all(s.refused_by == 0 and s.outcome is None for s in refused)


def test_plain_fairbatching_never_refuses() -> None:
    unit = make_unit(0, "fairbatching", cost=H100_LIKE, max_num_batched_tokens=8192, max_num_seqs=256)
    node, _, done = run_node([unit], requests([(6000, 20)] * 40), ttft_slo_s=0.5, tpot_slo_s=0.05)
    assert node.num_rejected == 0 and len(done) == 40
    assert unit.load().prefill_admission_budget is not None


def test_runs_on_the_simulated_node_with_migrations() -> None:
    """End to end on ``agent.runtime.node.Node``: every request finishes, hand-overs happen, nothing is lost."""
    rng = np.random.default_rng(1)
    pairs = [
        (min(int(np.exp(rng.normal(6.5, 1.5))) + 1, 8000), min(int(np.exp(rng.normal(5.0, 1.0))) + 1, 1500))
        for _ in range(300)
    ]
    reqs = requests(pairs, arrivals=sorted(rng.uniform(0, 5, 300).tolist()))
    units = [make_unit(i, cost=H100_LIKE, num_blocks=20_000, max_num_batched_tokens=8192) for i in range(4)]
    moved: collections.Counter[str] = collections.Counter()
    p = CascadeInfer({"min_partition_samples": 16})
    node = Node(units, p, reqs, ttft_slo_s=1e9, tpot_slo_s=1e9, on_migrate=lambda r: moved.update([r.reason]))
    node.run()
    assert node.num_finished == 300 and node.unfinished() == []
    assert len(p.stage_units) >= 2 and moved["handover"] > 0
    assert set(moved) <= {"handover", "rebalance", "starvation"}
