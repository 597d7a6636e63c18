"""TokenTable: parsing with line numbers, reload (also on SIGHUP) keeping the old table on a bad file,
constant-time lookups decided by hmac.compare_digest, single-token files, loopback detection."""

from __future__ import annotations

import os
import signal
import time

import pytest

from engine_service.api.errors import InvalidArgument
from engine_service.api.owners import MAX_OWNER_LENGTH
from engine_service.serving import tokens as auth
from engine_service.serving.tokens import TokenTable, is_loopback, parse_token_file, read_token_file

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef"


def write(path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_parses_pairs_comments_and_blank_lines(tmp_path) -> None:
    path = write(tmp_path / "tokens", f"# clients\n\n{ALICE} alice   # trailing comment\n  {BOB}\tbob\n")
    table = TokenTable.load(path)
    assert len(table) == 2 and table.owners() == {"alice", "bob"}
    assert table.owner_for(ALICE) == "alice" and table.owner_for(BOB) == "bob"
    assert table.owner_for("unknown-token-0123456789") is None
    assert table.owner_for(ALICE[:-1]) is None and table.owner_for(ALICE + "x") is None


def test_an_owner_may_have_several_tokens(tmp_path) -> None:
    table = TokenTable.load(write(tmp_path / "t", f"{ALICE} alice\n{BOB} alice\n"))
    assert table.owner_for(ALICE) == table.owner_for(BOB) == "alice"


@pytest.mark.parametrize(
    "text, message",
    [
        (f"{ALICE} alice\n{ALICE}\n", "t:2: expected 'token owner', got 1 field(s)"),
        (f"\n{ALICE} alice extra\n", "t:2: expected 'token owner', got 3 field(s)"),
        ("short alice\n", "t:1: a token must be at least 16 characters, got 5"),
        (f"{'x' * 600} alice\n", "t:1: a token must be at most 512 characters, got 600"),
        (f"{ALICE} {'o' * 129}\n", f"t:1: an owner must be 1..{MAX_OWNER_LENGTH} characters, got 129"),
        (f"{ALICE} alice\n# c\n{ALICE} bob\n", "t:3: this token is already listed on line 1"),
        (f"{ALICE}\x07x alice\n", "t:1: a token must not contain whitespace or control characters"),
        ("# only comments\n\n", "t: the token file lists no tokens"),
    ],
)
def test_bad_files_name_the_line(tmp_path, text, message) -> None:
    path = write(tmp_path / "t", text)
    with pytest.raises(InvalidArgument) as info:
        TokenTable.load(path)
    assert str(info.value) == path + message.removeprefix("t")


def test_missing_file_is_invalid_argument(tmp_path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read the token file"):
        TokenTable.load(str(tmp_path / "absent"))


def test_parse_returns_digests_not_tokens() -> None:
    entries = parse_token_file(f"{ALICE} alice\n", "f")
    assert entries[0][1] == "alice" and len(entries[0][0]) == 32 and ALICE.encode() not in entries[0][0]


def test_reload_swaps_the_table_and_keeps_the_old_one_when_bad(tmp_path, caplog) -> None:
    path = tmp_path / "tokens"
    table = TokenTable.load(write(path, f"{ALICE} alice\n"))
    write(path, f"{BOB} bob\n")
    assert table.reload() is True
    assert table.owner_for(BOB) == "bob" and table.owner_for(ALICE) is None
    write(path, f"{ALICE} alice\nbroken\n")
    with caplog.at_level("ERROR"):
        assert table.reload() is False
    assert table.owner_for(BOB) == "bob" and table.owner_for(ALICE) is None  # the old table stays
    assert any(
        f"{path}:2" in r.getMessage() and "keeping the previous 1 tokens" in r.getMessage()
        for r in caplog.records
    )
    path.unlink()
    assert table.reload() is False and table.owner_for(BOB) == "bob"


def test_sighup_reloads(tmp_path) -> None:
    path = tmp_path / "tokens"
    table = TokenTable.load(write(path, f"{ALICE} alice\n"))
    previous = signal.getsignal(signal.SIGHUP)
    try:
        auth.reload_on_sighup(table)
        write(path, f"{BOB} bob\n")
        os.kill(os.getpid(), signal.SIGHUP)
        deadline = time.monotonic() + 5
        while table.owner_for(BOB) is None and time.monotonic() < deadline:
            time.sleep(0.01)  # the handler runs in the main thread between bytecodes
        assert table.owner_for(BOB) == "bob" and table.owner_for(ALICE) is None
        write(path, "not a token file\n")
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.05)
        assert table.owner_for(BOB) == "bob"  # a bad file on reload keeps the old table
    finally:
        signal.signal(signal.SIGHUP, previous)


class RecordingCompare:
    """hmac.compare_digest stand-in: records every call and answers ``answer`` (or the real result)."""

    def __init__(self, answer: bool | None = None) -> None:
        self.calls: list[tuple[bytes, bytes]] = []
        self.answer = answer

    def __call__(self, a: bytes, b: bytes) -> bool:
        self.calls.append((a, b))
        return (a == b) if self.answer is None else self.answer


def test_compare_digest_decides_and_every_entry_is_compared(tmp_path, monkeypatch) -> None:
    tokens = [f"token-{i:02d}-0123456789abcdef" for i in range(8)]
    table = TokenTable.load(write(tmp_path / "t", "".join(f"{t} owner{i}\n" for i, t in enumerate(tokens))))
    for answer, presented, expected in (
        (None, tokens[0], "owner0"),
        (None, tokens[7], "owner7"),
        (None, "unknown-0123456789abcdef", None),
        (False, tokens[3], None),  # a valid token, refused
        (True, "unknown-0123456789abcdef", "owner0"),
    ):  # accepted
        fake = RecordingCompare(answer)
        monkeypatch.setattr(auth.hmac, "compare_digest", fake)
        assert table.owner_for(presented) == expected
        # no early exit: the first and the last entry cost the same number of comparisons, all of
        # fixed-length digests (the presented token's length does not show either)
        assert len(fake.calls) == len(tokens)
        assert all(len(a) == len(b) == 32 for a, b in fake.calls)


def test_read_token_file(tmp_path) -> None:
    assert read_token_file(write(tmp_path / "t", f"  {ALICE}\n\n")) == ALICE
    with pytest.raises(InvalidArgument, match="is empty"):
        read_token_file(write(tmp_path / "e", "\n"))
    with pytest.raises(InvalidArgument, match="whitespace"):
        read_token_file(write(tmp_path / "two", f"{ALICE} {BOB}\n"))


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("[::]", False),
        ("10.0.0.5", False),
        ("example.com", False),
    ],
)
def test_is_loopback(host, loopback) -> None:
    assert is_loopback(host) is loopback
