"""The library's defaults are the service's: EngineSessions.build with no settings builds the engine
``forkline-engine`` builds with no flags."""

from __future__ import annotations

import inspect

import pytest

from engine_service.__main__ import executor_settings, parse_args
from engine_service.api.errors import InvalidArgument
from engine_service.api.owners import NO_QUOTA, PERSISTENT_OWNER, OwnerQuota
from engine_service.executors.options import ExecutorSettings
from engine_service.sessions.engine import EngineSessions
from engine_service.sessions.settings import UNLIMITED, SessionSettings, session_settings


def test_build_defaults_are_the_engine_flag_defaults() -> None:
    args = parse_args([])
    defaults = inspect.signature(EngineSessions.build).parameters
    assert defaults["executor"].default == executor_settings(args) == ExecutorSettings()
    library, service = defaults["sessions"].default, session_settings(args, ExecutorSettings())
    assert library == SessionSettings() and library.persistent_owners == service.persistent_owners
    assert (
        (library.idle_timeout_s, library.prepared_inputs)
        == (service.idle_timeout_s, service.prepared_inputs)
        == (300.0, False)
    )
    assert library.quotas(ExecutorSettings()) == (service.quota, service.persistent_quota)
    assert library.quotas(ExecutorSettings()) == (
        OwnerQuota(64, 262144),
        OwnerQuota(128, 1048576),
    )  # by hand: 256 x 8192 (64 x 8192 / 2; 0.5 x 256 x 8192)


def test_flags_change_the_settings() -> None:
    """Negative control: the comparison above sees a flag that differs."""
    args = parse_args(["--idle_session_timeout", "5", "--owner_max_sessions", "0", "--persistent_owner", "p"])
    settings = session_settings(args, ExecutorSettings())
    assert settings.idle_timeout_s == 5.0 and settings.quota == OwnerQuota(0, 0)
    assert set(settings.persistent_owners) == {"p"} and PERSISTENT_OWNER not in settings.persistent_owners
    assert settings != SessionSettings()


def test_explicit_quotas_win_over_the_derived_ones() -> None:
    assert UNLIMITED.quotas(ExecutorSettings(max_sessions=4)) == (NO_QUOTA, NO_QUOTA)
    assert SessionSettings(quota=OwnerQuota(1, 2)).quotas(ExecutorSettings())[0] == OwnerQuota(1, 2)


def test_a_negative_idle_timeout_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidArgument, match="idle_timeout_s must be >= 0"):
        SessionSettings(idle_timeout_s=-1.0)
