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
