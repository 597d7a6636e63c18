"""The persistent tier: stored snapshots as files in one folder (``--snapshot_dir``), written behind the
request path and restored into an engine on demand."""
