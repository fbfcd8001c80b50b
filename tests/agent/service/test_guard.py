"""The connection guards without sockets: the auth backoff on an injected clock, the address it counts by, origins,
the bearer token."""

from __future__ import annotations

import pytest
from websockets.datastructures import Headers

from agent.service.guard import AuthThrottle, Backoff, ConnectionLimits, address_key, bearer_token, parse_origin


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_refusals_double_the_wait_up_to_its_cap_and_close_the_connection_at_the_limit() -> None:
    clock = Clock()
    throttle = AuthThrottle(Backoff(initial_s=0.1, max_s=1.0, max_failures=5, half_life_s=1e9), get_time=clock)
    delays = [throttle.failed("10.0.0.1", n) for n in range(1, 7)]
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert [throttle.closes(n) for n in (4, 5)] == [False, True]
    assert throttle.wait_s("10.0.0.1") == pytest.approx(1.0) and throttle.num_refused == 6
    clock.now += 0.6
    assert throttle.wait_s("10.0.0.1") == pytest.approx(0.4)
    assert throttle.wait_s("10.0.0.2") == 0.0, "another address is not slowed"


def test_connections_of_one_address_share_its_backoff_and_it_is_forgiven_with_time() -> None:
    clock = Clock()
    throttle = AuthThrottle(Backoff(initial_s=0.1, max_s=5.0, half_life_s=10.0), get_time=clock)
    for _ in range(4):  # four connections, one refusal each
        throttle.failed("192.0.2.7", 1)
    assert throttle.failed("192.0.2.7", 1) == pytest.approx(1.6), "the fifth connection waits the address's 0.1 * 2^4"
    clock.now += 20.0  # two half-lives: 5 refusals count as 1.25
    assert throttle.score("192.0.2.7") == pytest.approx(1.25)
    assert throttle.failed("192.0.2.7", 1) == pytest.approx(0.1 * 2**1.25)


def test_an_ipv6_host_is_counted_by_its_64_and_the_table_is_bounded() -> None:
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert address_key("::ffff:192.0.2.1") == "192.0.2.1" and address_key("unknown") == "unknown"
    clock = Clock()
    throttle = AuthThrottle(max_addresses=3, get_time=clock)
    for i in range(5):
        throttle.failed(f"10.0.0.{i}")
    assert [throttle.wait_s(f"10.0.0.{i}") > 0 for i in range(5)] == [False, False, True, True, True]


def test_origins_and_bearer_tokens() -> None:
    assert parse_origin("HTTPS://Grafana.Example.com:3000/") == "https://grafana.example.com:3000"
    for bad in ("grafana.example.com", "https://x.example/path", "https://user@x.example"):
        with pytest.raises(ValueError, match="SCHEME://HOST"):
            parse_origin(bad)
    assert ConnectionLimits(allow_origins=("https://a.example",)).origins == [None, "https://a.example"]
    assert bearer_token(Headers()) is None
    assert bearer_token(Headers({"Authorization": "Bearer s3cret"})) == "s3cret"
    assert bearer_token(Headers({"Authorization": "Basic czNjcmV0"})) == ""
    twice = Headers([("Authorization", "Bearer a"), ("Authorization", "Bearer b")])
    assert bearer_token(twice) == ""
