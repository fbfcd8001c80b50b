"""A live node keeps what is in flight, not every request it ever served (issue #21, item 9)."""

from __future__ import annotations

from node_builders import make_unit

from agent.runtime.node import Node
from agent.workload.types import RequestSpec
from policies.registry import make_dispatch_policy


def run(keep_finished: bool) -> tuple[Node, list[str], list[int]]:
    specs = [RequestSpec(f"r{i}", 0.5 * i, 16, 3) for i in range(40)]
    node = Node([make_unit(0), make_unit(1)], make_dispatch_policy("least_loaded", {}), specs, ttft_slo_s=10.0,
                tpot_slo_s=1.0, keep_finished=keep_finished)
    finished: list[str] = []
    held: list[int] = []
    node.on_finish = lambda o: finished.append(o.request_id)
    node.on_step = lambda rec: held.append(len(node.states))
    node.run()
    return node, finished, held


def test_an_ended_request_leaves_once_its_hooks_ran_and_the_counts_stay_whole() -> None:
    live, finished, held = run(keep_finished=False)
    assert sorted(finished) == sorted(f"r{i}" for i in range(40)), "every finish reached its hook"
    assert not live.states and live.num_arrived == 40 and live.num_finished == 40 and not live.unfinished()
    assert max(held) <= 8, "only what is in flight is held (two units, a request every 0.5 s, 1 s steps)"
    kept, _, _ = run(keep_finished=True)
    assert len(kept.states) == 40 and kept.num_arrived == 40
    assert [s.outcome for s in kept.states.values()] == [o for o in (s.outcome for s in kept.states.values()) if o]
