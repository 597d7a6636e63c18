"""The service entry points refuse bad flags before loading anything (argparse: exit status 2)."""

from __future__ import annotations

import pytest

from engine_service.__main__ import parse_args as engine_args
from prefix_service.__main__ import parse_args as prefix_args


@pytest.mark.parametrize("port", ["99999", "65536", "-1", "http"])
@pytest.mark.parametrize("parse", [engine_args, lambda argv: prefix_args(["--engine", "127.0.0.1:1", *argv])])
def test_port_outside_0_65535_exits_2(parse, port, capsys) -> None:
    # grpc would silently bind 99999 as 99999 % 65536 = 34463: a service on a port nobody asked for
    with pytest.raises(SystemExit) as info:
        parse(["--port", port])
    assert info.value.code == 2 and "--port" in capsys.readouterr().err


@pytest.mark.parametrize("parse", [engine_args, lambda argv: prefix_args(["--engine", "127.0.0.1:1", *argv])])
def test_valid_ports_parse(parse) -> None:
    assert [parse(["--port", p]).port for p in ("0", "50051", "65535")] == [0, 50051, 65535]


@pytest.mark.parametrize("flag", ["--max_cache_mib", "--max_entries", "--max_positions"])
def test_a_negative_prefix_budget_exits_2_naming_the_flag(flag, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        prefix_args(["--engine", "127.0.0.1:1", flag, "-1"])
    assert info.value.code == 2 and f"{flag} must be >= 0, got -1" in capsys.readouterr().err


def test_the_byte_budget_flags_parse_with_their_defaults() -> None:
    args = prefix_args(["--engine", "127.0.0.1:1"])
    assert (args.max_cache_mib, args.max_entries, args.max_positions) == (0, 4096, 0)
    assert prefix_args(["--engine", "127.0.0.1:1", "--max_cache_mib", "2048"]).max_cache_mib == 2048
    assert (engine_args([]).kv_memory_mib, engine_args([]).max_sessions) == (0, 256)
