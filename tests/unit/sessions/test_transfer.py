"""SessionTransfer's own checks, before any file is built or read."""

from __future__ import annotations

import pytest

from engine_service.api.errors import FailedPrecondition, InvalidArgument
from tests.unit.sessions.conftest import PERSISTENT, run, started


def test_imports_are_for_persistent_owners_only(sessions) -> None:
    with pytest.raises(FailedPrecondition, match="owner 'alice' is not one"):
        sessions.import_session("alice", [b"anything"])


def test_an_oversized_import_is_refused_before_it_is_read(make_sessions) -> None:
    engine = make_sessions(max_session_tokens=4)
    limit = engine.transfer.max_bytes()
    assert limit == (1 << 20) + 4 * (1 << 20)  # the header room plus 1 MiB a position
    read = []
    chunks = (read.append(i) or b"\0" * (1 << 20) for i in range(100))
    with pytest.raises(InvalidArgument, match=f"largest session \\({limit} bytes\\)"):
        engine.import_session(PERSISTENT, chunks)
    assert len(read) == 6  # stopped at the first chunk past the limit


@pytest.mark.parametrize(("upto", "extra"), [(4, {}), (-1, {}), (None, {"": "x"}), (None, {"k" * 129: "x"})])
def test_bad_export_arguments_are_invalid(sessions, upto, extra) -> None:
    handle = started(run(sessions, "alice", [5, 6, 7], max_new_tokens=1, keep_session=True)).session
    with pytest.raises(InvalidArgument, match="upto must be in \\[0, 3\\]" if not extra else "keys must be"):
        sessions.export_session("alice", handle, extra, upto)
