"""The bounded history a vLLM unit keeps of its records and outcomes (no vLLM needed)."""

from __future__ import annotations

import pytest

from agent.engine.vllm.history import History


def test_positions_count_from_the_first_item_ever() -> None:
    h: History[int] = History(4)
    assert not h and len(h) == 0 and h[0:] == []
    mark = len(h)
    for i in range(10):
        h.append(i)
    assert len(h) == 10 and h.num_dropped == 6 and list(h) == [6, 7, 8, 9]
    assert h[mark:] == [6, 7, 8, 9], "a slice from a dropped mark clips to what is kept"
    assert not h.kept_since(mark) and h.kept_since(6)
    assert h[8:] == [8, 9] and h[7:9] == [7, 8] and h[-1] == 9 and h[6] == 6 and h[12:] == []
    with pytest.raises(IndexError, match="position 5 is not kept"):
        h[5]
    with pytest.raises(ValueError):
        h[::2]


def test_a_unit_keeps_bounded_histories() -> None:
    pytest.importorskip("zmq")
    import asyncio

    from agent.engine.vllm.options import EngineOptions
    from agent.engine.vllm.unit import VllmUnit

    unit = VllmUnit(0, EngineOptions(model="tiny"), history=3)  # not started: nothing runs
    for i in range(5):
        unit.outcomes.append(i)  # type: ignore[arg-type]
    assert len(unit.outcomes) == 5 and list(unit.outcomes) == [2, 3, 4]
    assert unit.records.maxlen == unit.raw.maxlen == 3
    asyncio.run(unit.stop())
