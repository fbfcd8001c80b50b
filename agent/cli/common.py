"""What the ``trackside agent``/``ctl``/``record`` commands share: the error they exit 2 with, ``HOST:PORT`` parsing."""

from __future__ import annotations


class ServeError(Exception):
    """A problem with what the user asked for (printed as one line, exit 2)."""


def parse_listen(text: str, flag: str = "--listen") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ServeError(f"{flag} takes HOST:PORT, not {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)
