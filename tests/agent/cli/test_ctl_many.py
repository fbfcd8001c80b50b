"""``trackside ctl URI,URI,... ACTION`` (``agent.cli.ctl``): one request to several agents on loopback, as to the
agents of one node run with ``--agents N``. A change goes everywhere or nowhere: every agent checks it in a dry
run first."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from serve_harness import TOKEN, free_port, make_hub, make_server, run

from agent.cli.serve import main
from agent.service.hub import Hub


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


async def ctl(*argv: str) -> int:
    return await asyncio.to_thread(main, ["ctl", *argv])


def policies(hubs: list[Hub]) -> list[list[str]]:
    return [[u.batch_policy for u in hub.status().units] for hub in hubs]


def test_a_change_on_every_agent_or_on_none(token_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hubs = [make_hub(units=2), make_hub(units=3)]

    urls: list[str] = []

    async def go() -> list[tuple[int, list[list[str]]]]:
        async with make_server(hubs[0]) as a, make_server(hubs[1]) as b:
            urls.extend((a.url, b.url))
            both, t = f"{a.url},{b.url}", str(token_file)
            steps = []
            for argv in (
                [both, "--token-file", t, "set-policy", "sarathi"],  # both take it
                [both, "--token-file", t, "set-policy", "--unit", "2", "fairbatching"],  # a has no unit 2: nowhere
                [f"{a.url},ws://127.0.0.1:{free_port()}", "--token-file", t, "set-policy", "vllm"],  # one unreachable
                [both, "set-policy", "vllm"],  # no token: refused by both, nothing changes
                [both, "--json", "status"],
            ):
                steps.append((await ctl(*argv), policies(hubs)))
            return steps

    steps = run(go)
    out, err = capsys.readouterr()
    assert [code for code, _ in steps] == [0, 2, 1, 2, 0], err
    assert all(seen == [["sarathi"] * 2, ["sarathi"] * 3] for _, seen in steps), steps
    assert out.count(": applied: set_batch_policy: unit 0: sarathi") == 2  # one line per agent, under its URI
    assert f"trackside ctl: {urls[0]}: error: unknown_unit: no unit 2 (units: 0, 1)" in err
    assert f"{urls[1]}: dry_run: set_batch_policy: unit 2: fairbatching" in out  # b would have taken it
    assert err.count("nothing changed on any of the 2 agents") == 3
    assert "cannot reach ws://127.0.0.1:" in err
    statuses = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [len(s["reply"]["payload"]["units"]) for s in statuses] == [2, 3]
    assert [s["uri"] for s in statuses] == urls


def test_one_uri_is_one_agent_as_before(token_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hub = make_hub(units=2)

    async def go() -> int:
        async with make_server(hub) as a:
            return await ctl(a.url, "--token-file", str(token_file), "set-policy", "sarathi")

    assert run(go) == 0
    out = capsys.readouterr().out
    assert out.startswith("applied: set_batch_policy: unit 0: sarathi")  # no URI in front of it
