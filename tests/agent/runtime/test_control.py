"""Hot-swap and unit control under load: validation first, audit always, nothing lost or duplicated."""

from __future__ import annotations

import random

from node_builders import H100_LIKE, make_unit, requests

from agent.engine.base import RequestOutcome
from agent.runtime.control import NodeControl
from agent.runtime.node import Node
from policies.registry import BATCH_POLICIES, DISPATCH_POLICIES, make_dispatch_policy


def loaded_node(num_requests: int = 400, units: int = 4) -> tuple[Node, list[RequestOutcome]]:
    rng = random.Random(7)
    pairs = [(rng.randint(20, 1500), rng.randint(1, 120)) for _ in range(num_requests)]
    arrivals = sorted(rng.uniform(0.0, 20.0) for _ in range(num_requests))
    sim_units = [
        make_unit(k, "vllm", cost=H100_LIKE, num_blocks=2000, max_num_batched_tokens=2048, max_num_seqs=32)
        for k in range(units)
    ]
    done: list[RequestOutcome] = []
    node = Node(sim_units, make_dispatch_policy("least_loaded"), requests(pairs, arrivals),
                ttft_slo_s=0.5, tpot_slo_s=0.05, on_finish=done.append)
    return node, done


def accounted(node: Node) -> int:
    """Requests the node knows of, each counted exactly once wherever it is."""
    on_units = {rid for u in node.units for rid in u.requests}  # type: ignore[attr-defined]
    pending = set(node.pending)
    finished = {rid for rid, s in node.states.items() if s.outcome is not None}
    rejected = {rid for rid, s in node.states.items() if s.rejected}
    parts = [on_units, pending, finished, rejected]
    assert sum(len(p) for p in parts) == len(set().union(*parts)), "a request is in two places"
    return len(set().union(*parts))


def test_a_hundred_swaps_under_load_lose_and_duplicate_nothing() -> None:
    node, done = loaded_node()
    control = NodeControl(node, clock_ns=lambda: 42)
    rng = random.Random(1)
    batch = sorted(BATCH_POLICIES)
    t = 0.0
    for k in range(100):
        t += 0.25
        node.advance(t)
        assert accounted(node) == len(node.states)
        units = rng.choice([None, [rng.randrange(4)]])
        if k % 10 == 9:
            rec = control.set_dispatch_policy(rng.choice(sorted(DISPATCH_POLICIES)), who="test")
        else:
            rec = control.set_batch_policy(rng.choice(batch), units=units, who="test")
        assert rec.result == "applied", rec
    node.run()
    assert len(control.audit_log) == 100
    ids = [o.request_id for o in done]
    assert len(ids) == len(set(ids)), "a request finished twice"
    assert len(done) + node.num_rejected == 400 and not node.unfinished()


def test_unknown_policy_or_bad_params_change_nothing() -> None:
    node, _ = loaded_node(20)
    control = NodeControl(node)
    before = [u.policy for u in node.units]
    rec = control.set_batch_policy("no-such-policy", who="alice")
    assert rec.result == "rejected" and rec.error_code == "unknown_policy" and "no-such-policy" in (rec.error or "")
    rec = control.set_batch_policy("sarathi", {"tbt_target_ms": -5}, who="alice")
    assert rec.result == "rejected" and rec.error_code == "bad_param"
    rec = control.set_batch_policy("sarathi", units=[9], who="alice")
    assert rec.result == "rejected" and rec.error_code == "unknown_unit"
    assert [u.policy for u in node.units] == before
    assert [r.who for r in control.audit_log] == ["alice"] * 3


def test_param_changes_are_all_or_nothing_and_respect_live() -> None:
    node, _ = loaded_node(20, units=2)
    control = NodeControl(node)
    control.set_batch_policy("eb")
    rec = control.set_params({"theta": 0.2}, who="bob")
    assert rec.result == "applied" and rec.old == {"0": {"theta": 0.0}, "1": {"theta": 0.0}}
    assert all(u.policy.params["theta"] == 0.2 for u in node.units)
    rec = control.set_params({"theta": 0.3, "delta": 7.0})  # delta out of range: neither changes
    assert rec.result == "rejected" and all(u.policy.params["theta"] == 0.2 for u in node.units)
    rec = control.set_params({"window": 100})  # not live
    assert rec.result == "rejected" and "cannot change while running" in (rec.error or "")
    rec = control.set_params({"waiting_weight": 2.0}, target="dispatch")
    assert rec.result == "applied" and node.dispatcher.params["waiting_weight"] == 2.0


def test_dry_run_reports_and_changes_nothing() -> None:
    node, _ = loaded_node(20)
    control = NodeControl(node)
    rec = control.set_batch_policy("fairbatching", {"anchor": "first_token"}, dry_run=True)
    assert rec.result == "dry_run" and rec.new["params"]["anchor"] == "first_token"
    assert all(u.policy.name == "vllm" for u in node.units)
    assert rec.old["0"]["policy"] == "vllm"


def test_pause_drain_resume() -> None:
    node, done = loaded_node(200, units=2)
    control = NodeControl(node)
    node.advance(2.0)
    assert control.set_unit_mode(0, "paused").result == "applied"
    steps_before = node.units[0].step_index  # type: ignore[attr-defined]
    held = set(node.units[0].requests)  # type: ignore[attr-defined]
    node.advance(10.0)
    # Paused: at most the in-flight step finished; no new request came to it.
    assert node.units[0].step_index <= steps_before + 1  # type: ignore[attr-defined]
    assert set(node.units[0].requests) <= held  # type: ignore[attr-defined]
    assert control.set_unit_mode(1, "draining").result == "applied"
    node.advance(40.0)
    # Both out of service: arrivals wait at the dispatcher, nothing is lost.
    assert node.pending and not node.units[1].has_work()
    assert control.set_unit_mode(0, "active").result == "applied"
    assert control.set_unit_mode(0, "sleeping").result == "rejected"
    node.run()
    assert len(done) == 200 and not node.unfinished()
    assert control.status()["units"][1]["mode"] == "draining"
