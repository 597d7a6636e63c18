"""kill -9 of a process in the middle of writing snapshots: every file a listing returns afterwards reads
back whole and verified; what the killed write left (a temporary) is never listed, never loaded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine_service.api.snapshot_files import TEMP_SUFFIX, list_snapshots
from engine_service.persistence.snapshot_file import read_snapshot

ROOT = Path(__file__).resolve().parents[2]

WRITER = """
import sys, mlx.core as mx
import engine_service
from engine_service.cache.seq_state import SeqState
from engine_service.api.snapshot_files import StateLayout
from engine_service.persistence.snapshot import SessionSnapshot
from engine_service.persistence.snapshot_file import encode_snapshot, write_snapshot
from engine_service.api.snapshot_files import write_snapshot_bytes
arrays = {f"layers.{i}.{n}": mx.full((2, 4096, 64), float(i)) for i in range(8)
          for n in ("keys", "values")}  # 32 MiB: a write (with its fsync) takes a while
mx.eval(list(arrays.values()))
snap = SessionSnapshot("f" * 32, StateLayout("batched-sequence", "g"), SeqState(4096, 4096, arrays),
                       tuple(range(4096)))
write_snapshot(f"{sys.argv[1]}/s0.safetensors", snap)
data = encode_snapshot(snap)
print("ready", flush=True)
i = 1
while True:  # nothing but atomic writes from here on: a kill lands inside one
    write_snapshot_bytes(f"{sys.argv[1]}/s{i % 3}.safetensors", data)  # new files and replacements
    i += 1
"""


def test_files_listed_after_a_kill_mid_write_are_whole(tmp_path) -> None:
    verified = leftovers = 0
    for n, delay in enumerate((0.05, 0.3, 0.8)):  # the writer writes without pause: a kill lands mid-write
        folder = tmp_path / str(n)
        folder.mkdir()
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(folder)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
            time.sleep(delay)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
        listed = list_snapshots(folder)
        for path in listed:
            assert read_snapshot(path).positions == 4096  # SnapshotRefused for anything but a whole file
            verified += 1
        others = [p for p in folder.iterdir() if p not in listed]
        assert all(p.name.startswith(".") and p.name.endswith(TEMP_SUFFIX) for p in others), others
        leftovers += len(others)
    assert verified and leftovers, (verified, leftovers)  # both sides of the claim were exercised
