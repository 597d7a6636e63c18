"""deploy/sizing.json (the measurements and stated assumptions the manifests are sized from) and the
formulas docs/DEPLOY.md "Where the numbers come from" spells out, for the deploy tests.

Every formula returns what the manifests must say (a lower bound, or the exact value where the
manifests round the formula); the tests compare the rendered manifests with them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIZING = ROOT / "deploy" / "sizing.json"
MI = 2**20


@dataclass(frozen=True)
class Sizing:
    """deploy/sizing.json: ``measured`` (bench/bench_deploy.py on the named machine) and ``stated``
    (what only a cluster knows, assumed and named)."""

    measured: dict
    stated: dict

    @classmethod
    def load(cls, path: Path = SIZING) -> Sizing:
        data = json.loads(path.read_text(encoding="utf-8"))
        return cls(data["measured"], data["stated"])

    # -- rollout ------------------------------------------------------------------------------
    def engine_grace_s(self, max_session_tokens: int) -> int:
        """The longest generation the engine admits (every position generated) at the measured
        per-sequence decode rate with the stated concurrency, rounded up to 10 s."""
        return 10 * math.ceil(max_session_tokens / self.measured["decode_tokens_per_s_per_sequence"] / 10)

    def pre_stop_s(self, resolve_every_s: float) -> float:
        """preStop must be longer than this: endpoint removal + DNS TTL + one re-resolve."""
        return self.stated["endpoint_removal_s"] + self.stated["dns_ttl_s"] + resolve_every_s

    def termination_s(self, pre_stop_s: float, grace_s: float) -> float:
        """terminationGracePeriodSeconds at least: preStop + --grace + closing / releasing."""
        return pre_stop_s + grace_s + self.stated["close_s"]

    def stuck_after_min_s(self) -> float:
        """--stuck_after at least: the longest forward measured, times the stated margin."""
        return self.measured["longest_forward_s"] * self.stated["stuck_margin"]

    # -- resources ----------------------------------------------------------------------------
    def engine_memory_bytes(self, max_sessions: int, max_session_tokens: int) -> int:
        """The engine's memory limit: (idle RSS + every session full x bytes per position) x headroom,
        rounded up to 256 MiB."""
        need = (
            self.measured["idle_rss_bytes"]
            + max_sessions * max_session_tokens * self.measured["bytes_per_position"]
        ) * self.stated["memory_headroom"]
        return 256 * MI * math.ceil(need / (256 * MI))

    def snapshot_file_bytes(self, max_session_tokens: int) -> float:
        """One full-length snapshot file: its K/V at the stored dtype per position (stated: computed from
        the model's geometry)."""
        return max_session_tokens * self.stated["snapshot_bytes_per_position"]
