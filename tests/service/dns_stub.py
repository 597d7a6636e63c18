"""A stub DNS server on 127.0.0.1 (UDP, port 0) for the cluster tests: answers A / AAAA questions from
``records`` (name -> addresses, IPv4 and IPv6 mixed), or, while ``failing``, SERVFAIL (the resolver's
outage). Its own encoder (RFC 1035), independent of ``prefix_service/engines/dns_query.py``."""

from __future__ import annotations

import ipaddress
import socket
import struct
import threading

_A, _AAAA, _SERVFAIL = 1, 28, 2


def _question(message: bytes) -> tuple[str, int, int]:
    """(name, qtype, end offset of the question) of a one-question query."""
    labels, at = [], 12
    while message[at]:
        labels.append(message[at + 1 : at + 1 + message[at]].decode())
        at += 1 + message[at]
    qtype = struct.unpack(">H", message[at + 1 : at + 3])[0]
    return ".".join(labels), qtype, at + 5


class DnsStub:
    """See the module docstring. ``questions``: every name asked, in order."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.failing = False
        self.questions: list[str] = []
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def target(self, name: str, port: int) -> str:
        """The ``--engines`` flag that asks this server for ``name``."""
        return f"dns://127.0.0.1:{self.port}/{name}:{port}"

    def _serve(self) -> None:
        while True:
            try:
                message, peer = self._sock.recvfrom(512)
            except OSError:
                return
            name, qtype, end = _question(message)
            self.questions.append(name)
            flags = 0x8180 | (_SERVFAIL if self.failing else 0)  # a response, recursion available
            answers = []
            if not self.failing:
                for text in self.records.get(name, ()):
                    address = ipaddress.ip_address(text)
                    rtype = _A if address.version == 4 else _AAAA
                    if rtype == qtype:
                        data = address.packed
                        answers.append(struct.pack(">HHHIH", 0xC00C, rtype, 1, 5, len(data)) + data)
            header = struct.pack(">HHHHHH", struct.unpack(">H", message[:2])[0], flags, 1, len(answers), 0, 0)
            self._sock.sendto(header + message[12:end] + b"".join(answers), peer)

    def close(self) -> None:
        self._sock.close()
