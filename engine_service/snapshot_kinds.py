"""Why a snapshot was taken where it was: the one definition of the snapshot kinds.

The engine names them on snapshot events (``SnapshotEvent.kind``, ``stream_events.Snapshot.kind``);
the prefix cache stores them as an entry's ``boundary`` metadata, which retention policies read
(checkpoints outlive prompt snapshots).
"""

from __future__ import annotations

PROMPT = "prompt"  # at the end of the prompt: the whole prompt is reusable
BREAKPOINT = "breakpoint"  # at a prefill breakpoint inside the prompt: a shared checkpoint
