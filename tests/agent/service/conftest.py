"""Fixtures of the OpenAI intake's tests (``test_vllm_openai.py``; the harness is ``openai_served.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported in the fixture: the other tests here need no vLLM
    from openai_served import Served

    from policies.base import DispatchPolicy


@pytest.fixture(scope="module", params=[0, 2], ids=["in-process", "2-frontends"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    """The intake served from the agent's process, and from two front-end processes (``--openai-frontends 2``):
    every test of the module holds for both."""
    from openai_served import Served

    s = Served(request.param)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def dispatcher(served: Served) -> Iterator[Callable[[DispatchPolicy], None]]:
    """Swap the cluster's dispatcher for one test."""
    old: list[DispatchPolicy] = []

    def use(d: DispatchPolicy) -> None:
        old.append(served.set_attr(served.cluster, "dispatcher", d))

    yield use
    if old:
        served.set_attr(served.cluster, "dispatcher", old[0])


@pytest.fixture
def refusing(served: Served) -> Iterator[list[tuple[int, int]]]:
    """Every unit's admission control refuses every request for one test; what it was asked is recorded."""
    asked: list[tuple[int, int]] = []

    def refuses(unit_id: int, prompt_tokens: int) -> bool:
        asked.append((unit_id, prompt_tokens))
        return True

    served.set_attr(served.cluster, "refuses", refuses)
    try:
        yield asked
    finally:
        served.set_attr(served.cluster, "refuses", None)
