"""The GC controller: state restored, freezes, quiet-period and fallback collections, statistics, node hook."""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Iterator

import pytest
from node_builders import make_unit, requests

from agent.runtime.clock import VirtualClock, WallClock
from agent.runtime.gc_control import GcController, GcReason, GcSettings, freeze_startup_heap
from agent.runtime.node import Node
from policies.registry import make_dispatch_policy


class FakeNow:
    """Injected time: stands still unless moved, or moves ``tick`` seconds on every read."""

    def __init__(self, tick: float = 0.0) -> None:
        self.t = 1000.0
        self.tick = tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


class Tally:
    def __init__(self) -> None:
        self.alive = 0
        self.peak = 0


class Cycle:
    """A reference cycle that counts how many of its kind are alive."""

    def __init__(self, tally: Tally) -> None:
        self.me = self
        self.tally = tally
        tally.alive += 1
        tally.peak = max(tally.peak, tally.alive)

    def __del__(self) -> None:
        self.tally.alive -= 1


@pytest.fixture(autouse=True)
def gc_state() -> Iterator[None]:
    """Each test starts with nothing frozen, and the process's GC state is put back whatever happens."""
    threshold, enabled, callbacks = gc.get_threshold(), gc.isenabled(), list(gc.callbacks)
    gc.unfreeze()
    gc.collect()
    yield
    gc.set_threshold(*threshold)
    gc.unfreeze()
    gc.callbacks[:] = callbacks
    if enabled:
        gc.enable()
    gc.collect()


# Nothing due but what a test asks for: a full collection only through the setting under test.
QUIET_ONLY = GcSettings(full_every_s=1e9, full_after_young=1_000_000, fallback_s=1e9, fallback_young=1_000_000)


def test_previous_state_restored_on_exit_even_after_an_error() -> None:
    gc.set_threshold(600, 9, 8)
    gc.disable()
    callbacks = list(gc.callbacks)
    with pytest.raises(ZeroDivisionError), GcController(GcSettings(threshold0=5000, threshold1=20)):
        assert gc.get_threshold()[:2] == (5000, 20)
        assert gc.get_threshold()[2] > 1_000_000  # no automatic full collection
        assert len(gc.callbacks) == len(callbacks) + 1
        _ = 1 / 0
    assert gc.get_threshold() == (600, 9, 8)
    assert not gc.isenabled()
    assert gc.callbacks == callbacks
    assert gc.get_freeze_count() == 0


def test_default_keeps_young_thresholds_and_auto_full_can_be_kept() -> None:
    before = gc.get_threshold()
    with GcController():
        assert gc.get_threshold()[:2] == before[:2]
        assert gc.get_threshold()[2] != before[2]
    with GcController(GcSettings(auto_full=True)):
        assert gc.get_threshold() == before
    assert gc.get_threshold() == before


def test_freezes_at_start_and_unfreezes_on_exit() -> None:
    assert gc.get_freeze_count() == 0
    with GcController() as ctl:
        assert gc.get_freeze_count() > 1000  # at least the modules' objects
        assert ctl.stats()["num_freezes"] == 1
    assert gc.get_freeze_count() == 0


def test_objects_frozen_before_stay_frozen() -> None:
    gc.freeze()
    before = gc.get_freeze_count()
    with GcController():
        pass
    assert gc.get_freeze_count() >= before > 0


def test_quiet_collection_only_when_the_gap_is_long_enough() -> None:
    now = FakeNow()
    with GcController(QUIET_ONLY, now=now) as ctl:
        gc.collect(0)
        kept = [[i] for i in range(gc.get_threshold()[0] * 6 // 10)]  # generation 0 full enough to be worth it
        assert ctl.before_wait(0.004) is None
        assert ctl.before_wait(0.0) is None
        assert ctl.stats()["num_collections"]["quiet"] == 0
        assert ctl.before_wait(0.005) == "quiet"
        assert ctl.stats()["num_collections"]["quiet"] == 1
        assert gc.get_count()[0] < len(kept)
        # Just collected: generation 0 is empty again, nothing worth doing in the next quiet period.
        assert ctl.before_wait(1.0) is None


def test_quiet_full_collection_when_due_by_time_and_survivors_are_frozen() -> None:
    now = FakeNow()
    settings = GcSettings(full_every_s=10.0, full_after_young=1_000_000, fallback_s=1e9, fallback_young=1_000_000)
    with GcController(settings, now=now) as ctl:
        frozen = gc.get_freeze_count()
        kept = [[i] for i in range(2000)]
        now.t += 9.0
        assert ctl.before_wait(0.01) != "quiet_full"
        now.t += 1.0
        assert ctl.before_wait(0.001) is None  # due, but not quiet
        assert ctl.before_wait(0.01) == "quiet_full"
        assert gc.get_freeze_count() >= frozen + len(kept)
        assert ctl.stats()["num_collections"]["quiet_full"] == 1


def test_full_collection_when_young_collections_pile_up() -> None:
    settings = GcSettings(full_every_s=1e9, full_after_young=3, fallback_s=1e9, fallback_young=1_000_000)
    with GcController(settings, now=FakeNow()) as ctl:
        for _ in range(3):
            gc.collect(1)
        assert ctl.before_wait(0.001) is None
        assert ctl.before_wait(0.01) == "quiet_full"


def test_fallback_collects_a_loop_that_never_waits() -> None:
    now = FakeNow()
    settings = GcSettings(fallback_s=2.0, fallback_young=1_000_000)
    kept: list[list[int]] = []
    reasons: list[GcReason | None] = []
    with GcController(settings, now=now) as ctl:
        for _ in range(5000):  # 5 s of a loaded loop: 1 ms between events, never a wait, allocating
            now.t += 0.001
            kept.extend([i] for i in range(20))
            reasons.append(ctl.before_wait(0.0))
        stats = ctl.stats()
    assert stats["num_collections"]["fallback_full"] == 2
    assert stats["num_collections"]["quiet"] == stats["num_collections"]["quiet_full"] == 0
    # Decided at the first young collection after 2 s without a full one (every 35 events here).
    first, second = (i for i, r in enumerate(reasons) if r is not None)
    assert 1999 <= first < 2040 and first + 2000 <= second < first + 2040


def test_a_busy_loop_that_allocates_nothing_is_left_alone() -> None:
    now = FakeNow()
    with GcController(GcSettings(fallback_s=2.0, fallback_young=1_000_000), now=now) as ctl:
        gc.collect(1)
        assert ctl.stats()["num_collections"]["fallback_full"] == 0
        now.t += 10.0
        assert ctl.before_wait(0.0) is None  # no young collection since: nothing new to find
        gc.collect(0)
        assert ctl.before_wait(0.0) == "fallback_full"


def churn(ctl: GcController, now: FakeNow, tally: Tally, n: int = 150_000) -> None:
    """A loop that never waits: 1 ms per event, each event leaves a cycle that lives for 6,000 events.

    Those cycles live long enough to reach the oldest generation (or to be frozen) before they die, so only
    a full collection (or a thaw) frees them, and the controller turned CPython's automatic ones off.
    """
    window: deque[Cycle] = deque(maxlen=6000)
    for _ in range(n):
        now.t += 0.001
        window.append(Cycle(tally))
        ctl.before_wait(0.0)


def test_fallback_and_thaw_bound_the_garbage_of_a_loop_that_never_waits() -> None:
    now, tally = FakeNow(), Tally()
    with GcController(GcSettings(fallback_young=2, thaw_every_s=10.0), now=now) as ctl:
        churn(ctl, now, tally)
        stats = ctl.stats()
    assert stats["num_collections"]["fallback_full"] > 0 and stats["num_collections"]["thaw"] > 0
    assert stats["num_collected"] > 100_000  # the cycles (each with its instance dict) that the loop dropped
    # Alive: the window (6,000), and at most what died since the last thaw (forced every 20 s: 20,000).
    assert tally.peak < 30_000


def test_without_fallback_and_thaw_that_garbage_piles_up() -> None:
    """The check above can fail: the same loop with no fallback and no thaw keeps most of its garbage."""
    now, tally = FakeNow(), Tally()
    with GcController(QUIET_ONLY, now=now) as ctl:
        churn(ctl, now, tally)
    assert tally.peak > 90_000


def test_thaw_frees_cycles_that_died_frozen() -> None:
    now = FakeNow()
    settings = GcSettings(full_every_s=1.0, full_after_young=1_000_000, fallback_s=1e9, fallback_young=1_000_000,
                          thaw_every_s=100.0)
    with GcController(settings, now=now) as ctl:
        tally = Tally()
        dead = Cycle(tally)
        now.t += 1.0
        assert ctl.before_wait(1.0) == "quiet_full"  # survives, and is frozen
        del dead
        now.t += 1.0
        assert ctl.before_wait(1.0) == "quiet_full"
        assert tally.alive == 1  # frozen: no collection sees it
        now.t += 100.0
        assert ctl.before_wait(1.0) == "thaw"
        assert tally.alive == 0
        now.t += 199.0
        gc.collect(0)
        assert ctl.before_wait(0.0) is None
        now.t += 1.0
        assert ctl.before_wait(0.0) is None  # overdue twice over, but nothing was allocated since
        gc.collect(0)
        assert ctl.before_wait(0.0) == "thaw"  # forced even without a quiet period
        assert ctl.stats()["num_collections"]["thaw"] == 2


def test_stats_count_pauses_by_reason_and_generation() -> None:
    now = FakeNow(tick=0.001)  # every read moves 1 ms: each pause lasts exactly 1 ms
    with GcController(GcSettings(fallback_s=1e9, fallback_young=1_000_000), now=now) as ctl:
        kept = [[i] for i in range(5 * gc.get_threshold()[0])]  # enough allocations for CPython's own
        stats = ctl.stats()
    assert len(kept) > 0
    assert stats["num_collections"]["start"] == 1
    assert stats["num_collections"]["auto"] >= 1
    total = sum(stats["num_collections"].values())
    assert sum(stats["num_by_generation"]) == total
    assert stats["num_by_generation"][2] == 1  # only the start collection was full
    assert stats["total_pause_ms"] == pytest.approx(total * 1.0)
    assert stats["max_pause_ms"] == pytest.approx(1.0)
    assert stats["pause_ms"]["start"] == pytest.approx(1.0)
    assert stats["freeze_count"] > 0


def test_misuse_and_bad_settings_are_refused() -> None:
    ctl = GcController()
    with pytest.raises(RuntimeError):
        ctl.before_wait(1.0)
    with ctl, pytest.raises(RuntimeError):
        ctl.__enter__()
    assert not ctl.active
    for bad in ({"threshold0": 0}, {"fallback_s": 0.0}, {"fallback_young": 0}, {"thaw_every_s": 0.0}):
        with pytest.raises(ValueError):
            GcSettings(**bad)


class FakeTime:
    def __init__(self) -> None:
        self.t = 100.0

    def monotonic(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def test_clocks_report_the_wait_ahead() -> None:
    fake = FakeTime()
    clock = WallClock(4.0, monotonic=fake.monotonic, sleep=fake.sleep)
    assert clock.seconds_until(8.0) == 0.0  # the first wait starts the clock
    clock.wait_until(0.0)
    assert clock.seconds_until(8.0) == pytest.approx(2.0)
    fake.t += 3.0
    assert clock.seconds_until(8.0) == 0.0  # late: no wait
    assert VirtualClock().seconds_until(5.0) == 0.0


class RecordingController(GcController):
    def __init__(self, settings: GcSettings) -> None:
        super().__init__(settings, now=FakeNow())
        self.gaps: list[float] = []

    def before_wait(self, gap_s: float) -> GcReason | None:
        self.gaps.append(gap_s)
        return super().before_wait(gap_s)


def test_node_run_calls_the_hook_before_each_wait_with_the_real_gap() -> None:
    fake = FakeTime()
    reqs = requests([(8, 3), (8, 2)], arrivals=[0.0, 10.0])
    node = Node([make_unit()], make_dispatch_policy("round_robin"), reqs, ttft_slo_s=1.0, tpot_slo_s=1.0)
    with RecordingController(GcSettings(full_every_s=0.0)) as ctl:
        node.run(WallClock(2.0, monotonic=fake.monotonic, sleep=fake.sleep), gc_control=ctl)
        stats = ctl.stats()
    assert node.done and node.num_finished == 2
    # Waits for 0 (arrival and step start: the first wait starts the clock), 1, 2, 3 (steps of 1 s), 10 (arrival
    # and start), 11, 12; node time runs at 2x real time.
    assert ctl.gaps == pytest.approx([0.0, 0.5, 0.5, 0.5, 3.5, 0.5, 0.5])
    assert stats["num_collections"]["quiet_full"] == sum(g >= 0.005 for g in ctl.gaps)


def test_node_run_with_a_virtual_clock_never_sees_a_quiet_period() -> None:
    reqs = requests([(8, 3)] * 4, arrivals=[0.0, 1.0, 2.0, 30.0])
    node = Node([make_unit()], make_dispatch_policy("least_loaded"), reqs, ttft_slo_s=1.0, tpot_slo_s=1.0)
    with RecordingController(GcSettings(full_every_s=0.0)) as ctl:
        node.run(gc_control=ctl)
        stats = ctl.stats()
    assert node.done and node.num_finished == 4
    assert ctl.gaps and set(ctl.gaps) == {0.0}
    assert stats["num_collections"]["quiet_full"] == 0


def test_the_startup_heap_is_frozen_once_collected() -> None:
    # What the vLLM agent does once its engines and app are up (vLLM's own server does the same).
    class Cycle:
        def __init__(self) -> None:
            self.me = self

    Cycle()  # garbage in a cycle: collected, not frozen
    kept = [object() for _ in range(10)]
    gc.unfreeze()
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > len(kept)
        assert not any(isinstance(o, Cycle) for o in gc.get_objects())
        assert gc.get_count()[0] < 50 and len(gc.get_objects(generation=2)) < gc.get_freeze_count()
    finally:
        gc.unfreeze()

