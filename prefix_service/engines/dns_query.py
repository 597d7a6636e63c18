"""A minimal DNS client for ``--engines dns://SERVER:PORT/NAME:PORT``: A and AAAA questions over UDP to
one server (RFC 1035); an empty list is an answer (NXDOMAIN, no record), a failing server raises
:class:`DnsError`."""

from __future__ import annotations

import ipaddress
import secrets
import socket
import struct

A, AAAA = 1, 28
_IN = 1
_NXDOMAIN = 3


class DnsError(OSError):
    """The server did not answer the question (SERVFAIL, REFUSED, timeout, a malformed reply)."""


def encode_question(name: str, qtype: int, ident: int) -> bytes:
    labels = [label.encode("idna") for label in name.rstrip(".").split(".") if label]
    if any(len(label) > 63 for label in labels):
        raise DnsError(f"a label of {name!r} is longer than 63 bytes")
    header = struct.pack(">HHHHHH", ident, 0x0100, 1, 0, 0, 0)  # recursion desired, one question
    qname = b"".join(bytes([len(label)]) + label for label in labels) + b"\0"
    return header + qname + struct.pack(">HH", qtype, _IN)


def _skip_name(message: bytes, at: int) -> int:
    while True:
        if at >= len(message):
            raise DnsError("truncated name")
        length = message[at]
        if length & 0xC0 == 0xC0:  # a compression pointer ends the name
            return at + 2
        if length == 0:
            return at + 1
        at += 1 + length


def decode_answers(message: bytes, ident: int, qtype: int) -> list[str]:
    """The addresses of type ``qtype`` in the reply ``message`` to question ``ident``."""
    if len(message) < 12:
        raise DnsError("short reply")
    rid, flags, qdcount, ancount, _, _ = struct.unpack(">HHHHHH", message[:12])
    if rid != ident or not flags & 0x8000:
        raise DnsError("not the reply to this question")
    rcode = flags & 0x000F
    if rcode == _NXDOMAIN:
        return []
    if rcode != 0:
        raise DnsError(f"the server answered rcode {rcode}")
    at = 12
    for _ in range(qdcount):
        at = _skip_name(message, at) + 4
    addresses = []
    for _ in range(ancount):
        at = _skip_name(message, at)
        if at + 10 > len(message):
            raise DnsError("truncated answer")
        rtype, rclass, _ttl, length = struct.unpack(">HHIH", message[at : at + 10])
        at += 10
        data = message[at : at + length]
        at += length
        if rclass == _IN and rtype == qtype == A and length == 4:
            addresses.append(str(ipaddress.IPv4Address(data)))
        elif rclass == _IN and rtype == qtype == AAAA and length == 16:
            addresses.append(str(ipaddress.IPv6Address(data)))
    return addresses


def query(server: tuple[str, int], name: str, qtype: int, timeout: float = 1.0) -> list[str]:
    """Ask ``server`` (host, port) for the ``qtype`` records of ``name``."""
    ident = secrets.randbelow(1 << 16)
    question = encode_question(name, qtype, ident)
    family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.sendto(question, server)
            while True:
                reply, _ = sock.recvfrom(4096)
                try:
                    return decode_answers(reply, ident, qtype)
                except DnsError:
                    if reply[:2] != question[:2]:
                        continue  # a stray datagram: keep waiting for ours
                    raise
        except TimeoutError:
            raise DnsError(f"no answer from {server[0]}:{server[1]} within {timeout} s") from None
        except OSError as exc:
            if isinstance(exc, DnsError):
                raise
            raise DnsError(f"{server[0]}:{server[1]}: {exc}") from None
