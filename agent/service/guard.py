"""The agent's connection guards, without I/O: who may connect, how many, how long a subscriber may stop reading, and
how failed authentication is slowed.

The websocket server (``agent.service.server``) applies them: :class:`ConnectionLimits` is its configuration (the
``trackside agent`` flags ``--max-anonymous-connections``, ``--max-token-connections``, ``--subscriber-timeout-s``,
``--allow-origin``), :class:`AuthThrottle` the memory of refused tokens (per connection and per remote address), and
:func:`bearer_token` reads the token a client presents at connect. Time is injected (``get_time``), so the throttle
is tested without sleeping.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from websockets.datastructures import Headers
from websockets.typing import Origin


@dataclass(frozen=True, slots=True)
class Backoff:
    """How failed authentication is slowed: ``initial_s`` after the first refusal, doubling to ``max_s``."""

    initial_s: float = 0.1
    max_s: float = 5.0
    max_failures: int = 10
    """Refusals on one connection before it is closed (code 1008)."""
    half_life_s: float = 60.0
    """How fast an address's refusals are forgiven: its count halves every ``half_life_s`` without a refusal."""
    max_handshake_wait_s: float = 5.0
    """A handshake that presents a token waits for its address's backoff at most this long (its tries serialised with
    the address's other ones); beyond, it is refused with HTTP 429 and ``Retry-After``."""

    def delay_s(self, failures: float) -> float:
        """The wait after the ``failures``-th refusal (0 before any)."""
        if failures <= 0:
            return 0.0
        return min(self.initial_s * math.pow(2.0, min(failures - 1, 64)), self.max_s)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What one agent's websocket server allows (``AgentServer(limits=...)``)."""

    max_anonymous: int = 64
    """Open connections without a token at most; beyond it a handshake is refused with HTTP 503."""
    max_token: int = 256
    """Open connections that presented an accepted token at connect (``Authorization: Bearer``) at most."""
    subscriber_timeout_s: float | None = 30.0
    """A connection whose send has been blocked this long (its peer does not read) is closed with code 1008,
    "subscriber too slow", and counted (``StatusInfo.num_slow_dropped``); None: never."""
    max_send_bytes: int = 64 * 1024
    """Batch frames are cut at this size (an event alone above it still goes alone). A send waits while websockets'
    write buffer is above its limit (32 KiB), so a subscriber that does not read holds about one such frame."""
    close_timeout_s: float = 0.5
    """How long a closing connection (a slow subscriber, every one at stop) gets to finish its closing handshake
    before its socket is cut."""
    allow_origins: tuple[str, ...] = ()
    """Browser origins (``scheme://host[:port]``) allowed to connect; a request without ``Origin`` (any client but a
    browser) is always allowed."""
    backoff: Backoff = field(default_factory=Backoff)

    def __post_init__(self) -> None:
        if self.max_anonymous < 0 or self.max_token < 0:
            raise ValueError("connection limits must be >= 0")
        if self.subscriber_timeout_s is not None and not self.subscriber_timeout_s > 0:
            raise ValueError("the subscriber timeout must be > 0 (None: never)")
        if not self.close_timeout_s > 0:
            raise ValueError("the close timeout must be > 0")
        if self.max_send_bytes < 1024:
            raise ValueError("max_send_bytes must be at least 1 KiB")

    @property
    def origins(self) -> list[Origin | None]:
        """websockets' ``serve(origins=...)``: no ``Origin`` header, or one of :attr:`allow_origins`."""
        return [None, *(Origin(o) for o in self.allow_origins)]


def parse_origin(text: str) -> str:
    """``--allow-origin``'s value as browsers send it in ``Origin`` (``https://grafana.example.com:3000``: scheme,
    host and port, lower case, no path); raises ValueError saying what to write."""
    parts = urlsplit(text.strip().rstrip("/"))
    if not parts.scheme or not parts.netloc or parts.path or parts.query or parts.fragment or "@" in parts.netloc:
        raise ValueError(f"an origin is SCHEME://HOST[:PORT] (https://dashboard.example.com), not {text!r}")
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}"


def parse_origins(texts: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(parse_origin(t) for t in texts))


def bearer_token(headers: Headers) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header (None without one; "" for a malformed or repeated
    header, which no agent accepts)."""
    values = headers.get_all("Authorization")
    if not values:
        return None
    scheme, _, token = values[0].strip().partition(" ")
    if len(values) > 1 or scheme.lower() != "bearer":
        return ""
    return token.strip()


def address_key(host: str) -> str:
    """The unit that shares a backoff: an IPv4 address, or an IPv6 address's /64 (one host usually holds a whole
    /64, so counting its addresses one by one would not slow it)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


@dataclass(slots=True)
class _Address:
    score: float
    """Refusals, decayed with time."""
    at: float
    """When ``score`` was last updated."""
    not_before: float
    """No token from this address is looked at before then."""


class AuthThrottle:
    """Refused tokens, remembered per remote address (see :func:`address_key`), with exponential backoff.

    After a refusal a connection waits :meth:`failed`'s delay before its next frame: the larger of its own backoff
    (its refusals so far) and its address's (refusals from every connection of that address, forgiven with time:
    ``Backoff.half_life_s``). Until the address's backoff has passed (:meth:`wait_s`), no token from that address is
    looked at: control frames and handshakes that present a token wait (a handshake that would wait longer than
    ``max_handshake_wait_s`` is refused, HTTP 429). So tries from one address are serialised, one per backoff delay (at
    most 5 s by default), however many connections it opens. At most
    ``max_addresses`` addresses are remembered (the least recently refused are forgotten first).
    """

    def __init__(
        self, backoff: Backoff | None = None, *, max_addresses: int = 4096,
        get_time: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backoff = backoff or Backoff()
        self.max_addresses = max_addresses
        self._get_time = get_time
        self._addresses: dict[str, _Address] = {}
        self.num_refused = 0
        """Tokens refused over the server's life (control frames and handshakes)."""

    def wait_s(self, host: str) -> float:
        """How long the address's backoff still runs (0: a token from it may be looked at now)."""
        entry = self._addresses.get(address_key(host))
        return 0.0 if entry is None else max(0.0, entry.not_before - self._get_time())

    def score(self, host: str) -> float:
        """The address's refusals, decayed to now."""
        entry = self._addresses.get(address_key(host))
        return 0.0 if entry is None else self._decayed(entry, self._get_time())

    def failed(self, host: str, num_connection_failures: int = 1) -> float:
        """Count a refused token from ``host`` (the connection's ``num_connection_failures``-th); the delay before
        that connection may send its next frame."""
        now = self._get_time()
        key = address_key(host)
        entry = self._addresses.pop(key, None)  # re-inserted last: the dict's order is the eviction order
        score = (self._decayed(entry, now) if entry is not None else 0.0) + 1.0
        address_delay = self.backoff.delay_s(score)
        self._addresses[key] = _Address(score=score, at=now, not_before=now + address_delay)
        self.num_refused += 1
        if len(self._addresses) > self.max_addresses:
            del self._addresses[next(iter(self._addresses))]
        return max(self.backoff.delay_s(num_connection_failures), address_delay)

    def closes(self, num_connection_failures: int) -> bool:
        """Whether a connection with this many refusals is closed."""
        return num_connection_failures >= self.backoff.max_failures

    def _decayed(self, entry: _Address, now: float) -> float:
        return entry.score * math.pow(0.5, max(0.0, now - entry.at) / self.backoff.half_life_s)
