"""``trackside agent``'s connection flags, on the command line and in a node config file."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.cli.common import ServeError
from agent.cli.connections import connection_limits
from agent.cli.node_config import config_argv
from agent.cli.serve import agent_parser
from agent.service.guard import ConnectionLimits


def test_defaults_and_flags_make_the_servers_limits() -> None:
    assert connection_limits(agent_parser().parse_args([])) == ConnectionLimits()
    args = agent_parser().parse_args(["--max-anonymous-connections", "8", "--max-token-connections", "2",
                                      "--subscriber-timeout-s", "0", "--allow-origin", "https://Dash.example/",
                                      "--allow-origin", "http://localhost:3000"])
    limits = connection_limits(args)
    assert (limits.max_anonymous, limits.max_token, limits.subscriber_timeout_s) == (8, 2, None)
    assert limits.allow_origins == ("https://dash.example", "http://localhost:3000")
    for bad, message in ((["--allow-origin", "dash.example"], "--allow-origin: an origin is SCHEME://HOST"),
                         (["--subscriber-timeout-s", "-1"], "--subscriber-timeout-s must be >= 0"),
                         (["--max-anonymous-connections", "-1"], "must be >= 0")):
        with pytest.raises(ServeError, match=message):
            connection_limits(agent_parser().parse_args(bad))


def test_a_node_config_file_says_them_as_keys(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('max_anonymous_connections = 16\nsubscriber_timeout_s = 5\n'
                    'allow_origin = ["https://grafana.example.com"]\n')
    argv = config_argv(path, agent_parser)
    assert argv == ["--max-anonymous-connections", "16", "--subscriber-timeout-s", "5", "--allow-origin",
                    "https://grafana.example.com"]
    limits = connection_limits(agent_parser().parse_args(argv))
    assert (limits.max_anonymous, limits.subscriber_timeout_s, limits.allow_origins) == (
        16, 5.0, ("https://grafana.example.com",))
