"""The dispatch desk (agent/runtime/desk.py): one dispatch round, without a runtime around it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import pytest

from agent.runtime.desk import DispatchDesk, DispatchError, Placement, RejectReason, UnitAccess
from policies.base import DispatchPolicy
from policies.types import DispatchDecision, Migration, PendingRequest, UnitLoad


class Scripted(DispatchPolicy):
    """Returns the decisions it is given, one per call, and records what it was shown."""

    name = "scripted"

    def __init__(self, *decisions: DispatchDecision) -> None:
        super().__init__()
        self.decisions = list(decisions)
        self.shown: list[list[PendingRequest]] = []

    def dispatch(self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float) -> DispatchDecision:
        self.shown.append(list(pending))
        return self.decisions.pop(0) if self.decisions else DispatchDecision()


class Rebalancer(Scripted):
    rebalances: ClassVar[bool] = True


class Driver:
    """Records what the desk asks of the runtime; unit 9 is closed, unit 1 refuses prompts over ``budget``."""

    def __init__(self, budget: int = 10**9) -> None:
        self.budget = budget
        self.log: list[tuple[str, ...]] = []
        self.on: dict[str, int] = {"r": 0}
        """Where resident requests are (what a move may name as its source)."""
        self.in_transit: set[str] = set()
        self.paused: set[int] = set()

    def unit_access(self, unit_id: int) -> UnitAccess:
        return "closed" if unit_id == 9 else "open" if unit_id in (0, 1) else "unknown"

    def refuses(self, unit_id: int, prompt_tokens: int) -> bool:
        return unit_id == 1 and prompt_tokens > self.budget

    def dispatching(self, loads: Sequence[UnitLoad], decision: DispatchDecision) -> None:
        self.log.append(("dispatching",))

    def place(self, placement: Placement[str]) -> None:
        if placement.unit_id == 1:
            self.budget -= placement.request.prompt_tokens  # what a placement spends, as PAB's budget
        self.log.append(("place", placement.request.request_id, str(placement.unit_id), str(placement.carried),
                         str(placement.request.cycles_waited)))

    def refused(self, request: PendingRequest, unit_id: int) -> None:
        self.log.append(("refused", request.request_id, str(unit_id)))

    def rejected(self, request: PendingRequest, why: RejectReason) -> None:
        self.log.append(("rejected", request.request_id, why))

    def where(self, request_id: str) -> int | None:
        return self.on.get(request_id)

    def moving(self, request_id: str) -> bool:
        return request_id in self.in_transit

    def takes_moves(self, unit_id: int) -> bool:
        return unit_id not in self.paused and unit_id != 9

    def move(self, migration: Migration) -> None:
        self.in_transit.add(migration.request_id)  # as a runtime starting the move
        self.log.append(("move", migration.request_id, str(migration.target_unit)))

    def skip_move(self, migration: Migration) -> None:
        self.log.append(("skip", migration.request_id, str(migration.target_unit)))


def req(rid: str, arrival_s: float = 0.0, prompt: int = 10) -> PendingRequest:
    return PendingRequest(rid, arrival_s, prompt, 1.0, 0.05)


def desk_with(*rids: str, **kwargs: float | None) -> DispatchDesk[str]:
    desk: DispatchDesk[str] = DispatchDesk(**kwargs)  # type: ignore[arg-type]
    for i, rid in enumerate(rids):
        desk.add(req(rid, float(i)), 0.0)
    return desk


def test_placements_rejections_and_waits_in_order() -> None:
    desk = desk_with("a", "b", "c", "d")
    driver = Driver()
    d = Scripted(DispatchDecision(assignments=(("c", 0), ("a", 1)), rejected=("d",), next_check_s=5.0))
    assert desk.round(d, (), 1.0, driver) == 5.0
    assert driver.log == [("dispatching",), ("place", "c", "0", "None", "0"), ("place", "a", "1", "None", "0"),
                          ("rejected", "d", "dispatcher")]
    assert list(desk.pending) == ["b"] and desk.pending["b"].cycles_waited == 1 and desk.num_rounds == 1
    assert [p.request_id for p in d.shown[0]] == ["a", "b", "c", "d"]


def test_admission_control_sees_the_placements_made_before_it_in_the_same_round() -> None:
    desk = desk_with("a", "b", "c")
    driver = Driver(budget=15)
    desk.round(Scripted(DispatchDecision(assignments=(("a", 1), ("b", 1), ("c", 0)))), (), 0.0, driver)
    assert driver.log[1:] == [("place", "a", "1", "None", "0"), ("refused", "b", "1"), ("place", "c", "0", "None", "0")]
    assert not desk.pending


@pytest.mark.parametrize(
    "decision",
    [
        DispatchDecision(assignments=(("a", 0), ("a", 1))),
        DispatchDecision(assignments=(("zz", 0),)),
        DispatchDecision(assignments=(("a", 7),)),
        DispatchDecision(assignments=(("a", 9),)),
        DispatchDecision(assignments=(("a", 0),), rejected=("a",)),
    ],
    ids=["twice", "unknown-request", "unknown-unit", "closed-unit", "placed-and-rejected"],
)
def test_a_bad_decision_raises_when_strict_and_is_skipped_when_lenient(decision: DispatchDecision) -> None:
    with pytest.raises(DispatchError):
        desk_with("a", "b").round(Scripted(decision), (), 0.0, Driver())
    lenient = desk_with("a", "b", strict=False)
    driver = Driver()
    lenient.round(Scripted(decision), (), 0.0, driver)
    assert lenient.num_invalid == 1
    placed_or_ended = {entry[1] for entry in driver.log[1:]}
    assert set(lenient.pending) == {"a", "b"} - placed_or_ended, "a skipped entry's request stays pending"


def test_requeued_requests_go_first_in_arrival_order_and_skip_admission_control() -> None:
    desk = desk_with("late1", "late2")
    desk.requeue([(req("old2", -1.0, 50), "from-2"), (req("old1", -2.0, 50), "from-1")], 0.0)
    assert list(desk.pending) == ["old1", "old2", "late1", "late2"]
    assert desk.carried("old1") == "from-1" and desk.carried("late1") is None
    driver = Driver(budget=0)  # unit 1 refuses every new request
    desk.round(Scripted(DispatchDecision(assignments=(("old2", 1), ("late1", 1)))), (), 0.0, driver)
    assert driver.log[1:] == [("place", "old2", "1", "from-2", "0"), ("refused", "late1", "1")]
    with pytest.raises(ValueError, match="pending already"):
        desk.requeue([(req("late2"), "x")], 0.0)


def test_pending_timeout_rejects_what_waited_too_long_and_says_when_next() -> None:
    desk: DispatchDesk[str] = DispatchDesk(pending_timeout_s=2.0)
    desk.add(req("a"), 0.0)
    desk.add(req("b"), 1.5)
    driver = Driver()
    hold = Scripted(DispatchDecision(next_check_s=10.0), DispatchDecision(next_check_s=10.0))
    assert desk.round(hold, (), 1.5, driver) == 2.0, "a's timeout comes before the dispatcher's check"
    assert desk.round(hold, (), 2.0, driver) == 3.5
    assert driver.log[-1] == ("rejected", "a", "pending_timeout") and list(desk.pending) == ["b"]
    desk.requeue([(desk.remove("b") or req("b"), "x")], 3.0)  # back from a failed unit: its clock starts again
    assert desk.round(Scripted(), (), 4.0, driver) == 5.0


def test_no_check_is_asked_for_when_nothing_waits_and_a_rebalancer_is_asked_with_an_empty_queue() -> None:
    desk: DispatchDesk[str] = DispatchDesk()
    plain, rebalancer = Scripted(), Rebalancer(DispatchDecision(
        migrations=(Migration("r", 0, 1),), next_check_s=1.0))
    assert not desk.wants_round(plain) and desk.wants_round(rebalancer)
    driver = Driver()
    assert desk.round(rebalancer, (), 0.0, driver) is None
    assert driver.log == [("dispatching",), ("move", "r", "1")] and rebalancer.shown == [[]]


def test_migrations_pass_one_set_of_rules_each_checked_after_the_moves_before_it() -> None:
    desk: DispatchDesk[str] = DispatchDesk()
    driver = Driver()
    driver.on.update({"s": 1, "t": 0, "u": 0})
    driver.in_transit.add("t")
    driver.paused.add(1)
    moves = (
        Migration("r", 0, 1),  # target paused
        Migration("r", 0, 0),  # same unit
        Migration("r", 0, 7),  # unknown target
        Migration("s", 0, 1),  # not on the named source
        Migration("t", 0, 1),  # moving already
        Migration("zz", 0, 1),  # not on any unit
        Migration("u", 0, 9),  # target closed
    )
    desk.round(Rebalancer(DispatchDecision(migrations=moves)), (), 0.0, driver)
    assert [e[0] for e in driver.log[1:]] == ["skip"] * len(moves)
    driver.paused.clear()
    driver.log.clear()
    twice = (Migration("r", 0, 1), Migration("r", 0, 1), Migration("u", 0, 1))
    desk.round(Rebalancer(DispatchDecision(migrations=twice)), (), 0.0, driver)
    assert driver.log[1:] == [("move", "r", "1"), ("skip", "r", "1"), ("move", "u", "1")], \
        "the second move of r is checked after the first started"


def test_remove_takes_a_request_off_the_queue_once() -> None:
    desk = desk_with("a", "b", pending_timeout_s=1.0)
    assert desk.remove("a") == req("a", 0.0) and desk.remove("a") is None
    assert list(desk.pending) == ["b"] and "a" not in desk and len(desk) == 1
    with pytest.raises(ValueError, match="pending already"):
        desk.add(req("b"), 0.0)


# -- the simulated node through the desk ----------------------------------------------------------------------------


def test_simulated_node_rejects_what_no_unit_took_within_the_pending_timeout() -> None:
    from node_builders import make_unit

    from agent.runtime.node import Node
    from agent.workload.types import RequestSpec

    hold = Scripted(*[DispatchDecision(next_check_s=100.0)] * 10)  # never places anything
    node = Node([make_unit(0)], hold, [RequestSpec("a", 1.0, 16, 4), RequestSpec("b", 2.5, 16, 4)],
                ttft_slo_s=1.0, tpot_slo_s=0.1, pending_timeout_s=2.0)
    ended: dict[str, float] = {}
    node.on_request = lambda kind, s: ended.setdefault(s.spec.request_id, node.now_s) if kind == "refused" else None
    node.run()
    assert ended == {"a": 3.0, "b": 4.5} and node.num_rejected == 2
    assert all(s.refusal_reason == "pending_timeout" for s in node.states.values())
    with pytest.raises(DispatchError, match="closed to it"):
        node2 = Node([make_unit(0)], Scripted(DispatchDecision(assignments=(("a", 5),))),
                     [RequestSpec("a", 0.0, 16, 4)], ttft_slo_s=1.0, tpot_slo_s=0.1)
        node2.run()


def test_a_failed_units_requests_go_back_first_in_arrival_order_and_keep_their_tokens() -> None:
    from node_builders import make_unit

    from agent.runtime.node import Node
    from agent.workload.types import RequestSpec
    from policies.registry import make_dispatch_policy

    specs = [RequestSpec(f"r{i}", 0.001 * i, 64, 400) for i in range(6)] + [RequestSpec("late", 3.6, 64, 4)]
    node = Node([make_unit(0), make_unit(1)], make_dispatch_policy("least_loaded", {}), specs,
                ttft_slo_s=10.0, tpot_slo_s=1.0)
    node.advance(3.5)  # steps last 1 s: three steps done
    on_zero = sorted(rid for rid, s in node.states.items() if s.unit_id == 0)
    node.set_unit_mode(0, "draining")
    node.set_unit_mode(1, "paused")  # nowhere to go: "late" and then the evacuated requests wait at the dispatcher
    node.advance(3.8)
    assert list(node.pending) == ["late"]
    assert node.fail_unit(0) == len(on_zero)
    assert list(node.pending) == [*on_zero, "late"], "sent back, they queue before the later arrival"
    carried = node.desk.carried(on_zero[0])
    assert carried is not None and carried.num_tokens > 64
    assert node.pending[on_zero[0]].prompt_tokens == carried.num_tokens
    node.set_unit_mode(1, "active")
    node.run()
    assert not node.unfinished() and node.num_rejected == 0
    assert all(node.states[rid].outcome.output_tokens == 400 for rid in on_zero)  # type: ignore[union-attr]
