"""CascadeInfer's migration planning: hand-over, bid-ask rebalancing, the transfer queue (seed 001 section 4.4).

POLICIES.md 2.4, steps 4 and 5 of :mod:`policies.dispatch.cascade`. :class:`MigrationPlanner` keeps the
queue of won transfers between calls and, given the installed stages (:class:`StageMap`), plans each call's
migrations:

- **Asks.** A unit holding a request whose context reached its stage's upper boundary hands it to the stage
  covering its length (reason ``handover``); a unit whose demand exceeds its stage's mean by more than
  ``imbalance_threshold`` offers its longest requests that fit in the excess (reason ``rebalance``; at most
  ``max_transfers`` asks per sender and call, and only while the receiver would stay below the sender).
- **Bids.** Candidate receivers bid :class:`Bid` ``(load, earliest start)``; :func:`select_bid` drops the
  more loaded half, keeps the three earliest and takes the first to answer (the earliest). A receiver
  without free KV for the request's context does not bid. The winner queues the request.
- **Transfers.** At most ``max_transfers`` in flight, one outgoing per sender and one new incoming per
  receiver per call; receivers take their queue in order of the sender's load. A skip counts once per
  distinct blocking transfer; after more than ``starvation_limit`` the request escalates (reason
  ``starvation``).

Pure: stdlib only, no clock, no I/O; every iteration in a sorted order.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from policies.cost.step_model import StepCoefficients
from policies.dispatch.cascade_stages import StageMap, demand_tokens
from policies.frozen import picklable
from policies.types import Migration, RunningRequest, UnitLoad

__all__ = ["Bid", "BidAskConfig", "BidOutcome", "MigrationPlanner", "select_bid"]


@dataclass(frozen=True, slots=True)
class Bid:
    """A receiver's reply to an ask (section 4.4)."""

    unit_id: int
    load_tokens: float
    """Memory demand plus tokens already won."""
    earliest_start_s: float
    """Buffered tokens over throughput: when it could start on the request."""


@dataclass(frozen=True, slots=True)
class BidOutcome:
    """The sender's filtering of the bids."""

    winner: Bid | None
    less_loaded: tuple[Bid, ...]
    """Bids left after dropping the more loaded half (ascending load)."""
    earliest: tuple[Bid, ...]
    """Up to ``keep`` of those with the earliest start (ascending start)."""


def select_bid(bids: Sequence[Bid], keep: int = 3) -> BidOutcome:
    """Drop the more loaded half (``floor(n / 2)`` bids), keep the ``keep`` earliest, take the first.

    "The first to answer" is the earliest start (the bid that could begin soonest); ties go to the lower
    load, then the lower unit id. With one bid nothing is dropped.
    """
    by_load = sorted(bids, key=lambda b: (b.load_tokens, b.unit_id))
    less = tuple(by_load[: len(by_load) - len(by_load) // 2])
    earliest = tuple(sorted(less, key=lambda b: (b.earliest_start_s, b.load_tokens, b.unit_id))[:keep])
    return BidOutcome(earliest[0] if earliest else None, less, earliest)


@dataclass(frozen=True, slots=True)
class BidAskConfig:
    """The policy parameters migration planning reads (built by ``CascadeInfer.configure``)."""

    imbalance_threshold: float
    """Rebalance a unit whose demand exceeds its stage's mean by this fraction."""
    rebalance: bool
    """Intra-stage bid-ask rebalancing (hand-over runs regardless)."""
    max_transfers: int
    """Migrations in flight at once (also the asks per sender and call)."""
    starvation_limit: int
    """Skips before a queued migration escalates."""
    chunk_tokens: int
    """Token budget per step of a unit that reports none."""
    step: StepCoefficients
    """Step model for a unit without a measured mean step time."""


@dataclass(slots=True)
class _Transfer:
    """A request won by a receiver, waiting in its queue."""

    request_id: str
    source: int
    target: int
    tokens: int
    reason: str
    seq: int
    skips: int = 0
    last_blocker: str = ""
    starving: bool = False


class MigrationPlanner:
    """The transfer queue and its bookkeeping across calls; :meth:`plan` decides one call's migrations."""

    def __init__(self) -> None:
        self._queue: dict[str, _Transfer] = {}
        self._seq = 0
        self._seen_steps: dict[int, int] = {}
        self._full_scan = True

    @property
    def num_queued(self) -> int:
        """Transfers won and waiting to start."""
        return len(self._queue)

    def reset(self) -> None:
        """New stages: drop the queue and rescan every unit at the next call."""
        self._queue.clear()
        self._full_scan = True

    def rescan(self) -> None:
        """A boundary moved: rescan every unit at the next call, not only those that reported a step."""
        self._full_scan = True

    @staticmethod
    def _throughput(u: UnitLoad, config: BidAskConfig) -> float:
        """Tokens per second: the unit's token budget per step over its (measured or modelled) step time."""
        chunk = u.chunk_tokens if u.chunk_tokens > 0 else config.chunk_tokens
        step_s = u.mean_step_s if u.mean_step_s else config.step.predict_s(chunk, u.kv_tokens)
        return chunk / step_s if step_s > 0 else math.inf

    def plan(
        self,
        units: Sequence[UnitLoad],
        by_id: Mapping[int, UnitLoad],
        stages: StageMap,
        config: BidAskConfig,
    ) -> tuple[tuple[Migration, ...], int]:
        """This call's migrations to start, and the number of transfers in flight before them."""
        migrating: set[str] = set()
        blocker: dict[int, str] = {}  # sender -> the transfer it is busy with
        for u in units:
            if not any(map(_IS_MIGRATING, u.requests)):  # a C-level pass: most units move nothing
                continue
            for r in u.requests:
                if r.migrating:
                    migrating.add(r.request_id)
                    if u.unit_id not in blocker or r.request_id < blocker[u.unit_id]:
                        blocker[u.unit_id] = r.request_id
        inflight = max(len(migrating), -(-sum(u.migrations_inflight for u in units) // 2))
        residents: dict[int, dict[str, RunningRequest]] = {}

        def resident(uid: int) -> dict[str, RunningRequest]:
            got = residents.get(uid)
            if got is None:
                got = residents[uid] = {r.request_id: r for r in by_id[uid].requests}
            return got

        changed = (
            None if self._full_scan else {u.unit_id for u in units if u.steps_done != self._seen_steps.get(u.unit_id)}
        )
        self._validate_queue(by_id, stages, migrating, resident, changed)
        queued_in: dict[int, int] = {u: 0 for u in by_id}
        queued_out: dict[int, int] = {u: 0 for u in by_id}
        for t in self._queue.values():
            queued_in[t.target] += t.tokens
            queued_out[t.source] += t.tokens

        def ask(r: RunningRequest, sender: int, receivers: Sequence[int], reason: str, guard: float | None) -> bool:
            x = r.context_tokens
            bids: list[Bid] = []
            for uid in receivers:
                lu = by_id.get(uid)
                if uid == sender or lu is None or not lu.healthy:
                    continue
                if lu.free_kv_tokens - queued_in[uid] < x:
                    continue
                load = demand_tokens(lu) + queued_in[uid]
                if guard is not None and load + x > guard - x:
                    continue
                start = (queued_in[uid] + lu.queued_prefill_tokens) / self._throughput(lu, config)
                bids.append(Bid(uid, float(load), start))
            winner = select_bid(bids).winner
            if winner is None:
                return False
            self._seq += 1
            self._queue[r.request_id] = _Transfer(r.request_id, sender, winner.unit_id, x, reason, self._seq)
            queued_in[winner.unit_id] += x
            queued_out[sender] += x
            return True

        last = len(stages.members) - 1
        bounds = stages.int_bounds()
        scan = [uid for uid in sorted(stages.stage_of) if uid in by_id and (changed is None or uid in changed)]
        for uid in scan:
            j = stages.stage_of[uid]
            if j == last:
                continue
            upper = bounds[j + 1]
            for r in by_id[uid].requests:
                if (
                    r.context_tokens >= upper
                    and not r.migrating
                    and r.request_id not in self._queue
                    and r.request_id not in migrating
                ):
                    target = stages.stage_for_length(r.context_tokens)
                    if target > j:
                        ask(r, uid, stages.members[target], "handover", None)
        self._seen_steps = {u.unit_id: u.steps_done for u in units}
        self._full_scan = False
        if config.rebalance and config.max_transfers > 0:
            for members in stages.members:
                if len(members) < 2:
                    continue
                dem = {m: demand_tokens(by_id[m]) for m in members}
                mean = sum(dem.values()) / len(dem)
                for m in sorted(members, key=lambda k: (-dem[k], k)):
                    if dem[m] <= (1.0 + config.imbalance_threshold) * mean:
                        break
                    if changed is not None and m not in changed:
                        continue  # its demand and requests are as at its last report, when it already asked
                    excess = dem[m] - mean - queued_out[m]
                    cands = sorted(
                        (
                            r
                            for r in by_id[m].requests
                            if not r.migrating
                            and r.request_id not in self._queue
                            and r.request_id not in migrating
                            and r.context_tokens > 0
                        ),
                        key=lambda r: (-r.context_tokens, r.request_id),
                    )
                    asks = 0
                    for r in cands:
                        if asks >= config.max_transfers or excess <= 0:
                            break
                        if r.context_tokens > excess:
                            continue
                        if ask(r, m, members, "rebalance", float(dem[m] - queued_out[m])):
                            excess -= r.context_tokens
                            asks += 1
        return self._start_transfers(by_id, config, blocker, inflight, queued_out, resident), inflight

    def _validate_queue(
        self,
        by_id: Mapping[int, UnitLoad],
        stages: StageMap,
        migrating: set[str],
        resident: Callable[[int], dict[str, RunningRequest]],
        changed: set[int] | None,
    ) -> None:
        """Drop queued transfers that no longer make sense; refresh their sizes.

        Residency and size are rechecked for senders that reported a step since the last call (``changed``;
        None: all), since requests leave a unit and grow only at step ends; a transfer about to start is
        checked again in :meth:`_start_transfers`.
        """
        bounds = stages.int_bounds()
        last = len(stages.members) - 1
        for rid, t in list(self._queue.items()):  # insertion order = seq order
            src, dst = by_id.get(t.source), by_id.get(t.target)
            ok = (
                src is not None
                and dst is not None
                and src.healthy
                and dst.healthy
                and t.source != t.target
                and rid not in migrating
                and t.source in stages.stage_of
                and t.target in stages.stage_of
            )
            if ok and changed is not None and t.source not in changed:
                continue
            r = resident(t.source).get(rid) if ok else None
            if r is None or r.migrating:
                del self._queue[rid]
                continue
            j = stages.stage_of[t.source]
            if t.reason == "handover" and (j == last or r.context_tokens < bounds[j + 1]):
                del self._queue[rid]
                continue
            t.tokens = r.context_tokens

    def _start_transfers(
        self,
        by_id: Mapping[int, UnitLoad],
        config: BidAskConfig,
        blocker: dict[int, str],
        inflight: int,
        queued_out: dict[int, int],
        resident: Callable[[int], dict[str, RunningRequest]],
    ) -> tuple[Migration, ...]:
        slots = config.max_transfers - inflight
        started: list[Migration] = []
        used_receivers: set[int] = set()
        reserved: dict[int, int] = {}

        def kv_ok(t: _Transfer) -> bool:
            """Still resident and not moving, and the receiver has room (else: drop, ask again later)."""
            r = resident(t.source).get(t.request_id)
            if r is None or r.migrating:
                return False
            t.tokens = r.context_tokens
            return by_id[t.target].free_kv_tokens - reserved.get(t.target, 0) >= t.tokens

        def start(t: _Transfer, reason: str) -> None:
            nonlocal slots
            started.append(Migration(t.request_id, t.source, t.target, reason))
            del self._queue[t.request_id]
            blocker[t.source] = t.request_id
            used_receivers.add(t.target)
            reserved[t.target] = reserved.get(t.target, 0) + t.tokens
            slots -= 1

        starving = sorted(
            (t for t in self._queue.values() if t.starving),
            key=lambda t: (-t.skips, -queued_out[t.source], t.seq),
        )
        for t in starving:
            if slots <= 0:
                break
            if t.source in blocker or t.target in used_receivers:
                continue
            if not kv_ok(t):
                del self._queue[t.request_id]
                continue
            start(t, "starvation")
        waiting = {t.target for t in self._queue.values() if t.starving}
        by_target: dict[int, list[_Transfer]] = {}
        for t in self._queue.values():
            by_target.setdefault(t.target, []).append(t)
        for rcv in sorted(by_target):
            if slots <= 0:
                break
            if rcv in waiting or rcv in used_receivers:
                continue
            for t in sorted(by_target[rcv], key=lambda t: (-queued_out[t.source], t.seq)):
                busy_with = blocker.get(t.source)
                if busy_with is not None:
                    if busy_with != t.last_blocker:
                        t.last_blocker = busy_with
                        t.skips += 1
                        if t.skips > config.starvation_limit:
                            t.starving = True
                            break  # the receiver now waits for this one
                    continue
                if not kv_ok(t):
                    del self._queue[t.request_id]
                    continue
                start(t, t.reason)
                break
        return tuple(started)


_IS_MIGRATING = operator.attrgetter("migrating")


picklable(Bid, BidOutcome, BidAskConfig)  # compiled with mypyc (setup.py): see picklable
