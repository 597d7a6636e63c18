"""mlx_run_llm_batched --snapshot_dir --snapshot_key across separate processes (a tiny GGUF; about a
second a run): the threat and the fix through the CLI's own folder.

Whoever can write the folder replaces prompt B's file by a self-consistent forgery: B's content, A's
K/V, the digest and plain checksum recomputed with the public code. Without a key the next run loads
it and B's answer changes (the negative control: the threat is real). With a key the forgery is
refused as ``unsigned`` and removed, B runs cold and is written again, signed; a run without the key
refuses signed files (``bad_signature``), and so does a run with another key.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys

import pytest

from clients.run_llm_batched import main
from engine_service.api.snapshot_files import peek_snapshot
from engine_service.model.random_init import random_tensors, tiny_config
from engine_service.persistence.snapshot import SessionSnapshot
from engine_service.persistence.snapshot_file import encode_snapshot, read_snapshot
from engine_service.persistence.snapshot_key import read_snapshot_key
from tests.model.gguf_writer import write_gguf
from tests.model.test_cli import REUSE, ROOT
from tests.unit.model.test_loading import gguf_metadata, gguf_tensors

PROMPTS = ("abc def ghi jkl mno pqr", "pqr mno jkl ghi def abc")  # as many positions each
# sampled (seeded per prompt): the tiny random model is so peaked that greedy answers hardly depend on K/V
LOADED = re.compile(r"^snapshots: loaded (\d+) from .*?\((\d+) positions\)(.*)$", re.M)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_gguf(str(path), gguf_metadata(), gguf_tensors(random_tensors(tiny_config("FR", 4), seed=11)))
    return str(path)


def key_file(folder, name: str = "key"):
    path = folder / name
    path.write_text(secrets.token_urlsafe(32) + "\n")
    os.chmod(path, 0o600)
    return path


def run(model: str, folder, out, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    argv = [
        "--model", model, "--weights_dtype", "float32", "--prefix_cache_entries", "2",
        "--snapshot_dir", str(folder), "--max_new_tokens", "8", "--max_session_tokens", "128", "--temperature", "10",
        "--out_prefix", str(out), *extra, *PROMPTS,
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "clients.run_llm_batched", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def loaded(proc) -> tuple[int, str]:
    match = LOADED.search(proc.stdout)
    assert match, proc.stdout
    return int(match.group(1)), match.group(3)


def reused(proc) -> list[int]:
    return [int(m.group(3)) for m in map(REUSE.match, proc.stdout.splitlines()) if m]


def texts(prefix) -> list[str]:
    return [open(f"{prefix}_{i}.txt").read() for i in range(len(PROMPTS))]


def forge(folder, key=None) -> None:
    """Replace one prompt's file by the other prompt's K/V under the first one's content, digest and
    plain checksum recomputed (no MAC: the forger has no key)."""
    a, b = sorted(folder.glob("*.safetensors"))
    sa, sb = read_snapshot(a, key=key), read_snapshot(b, key=key)
    assert sa.positions == sb.positions and sa.content != sb.content
    forged = SessionSnapshot(sb.fingerprint, sb.layout, sa.state, sb.content, sb.extra)
    b.write_bytes(encode_snapshot(forged))


def test_without_a_key_a_forged_file_is_served(tiny_gguf, tmp_path) -> None:
    folder = tmp_path / "snapshots"
    run(tiny_gguf, folder, tmp_path / "cold")
    forge(folder)
    poisoned = run(tiny_gguf, folder, tmp_path / "poisoned")
    assert loaded(poisoned) == (2, "")  # the forgery passed every check
    assert all(r > 0 for r in reused(poisoned))
    changed = [x != y for x, y in zip(texts(tmp_path / "cold"), texts(tmp_path / "poisoned"), strict=True)]
    assert changed.count(True) == 1, changed  # the forged prompt's answer is another prompt's K/V's


def test_with_a_key_the_forgery_is_refused_removed_and_replaced_signed(tiny_gguf, tmp_path) -> None:
    folder, key = tmp_path / "snapshots", key_file(tmp_path)
    first = run(tiny_gguf, folder, tmp_path / "cold", "--snapshot_key", str(key))
    assert loaded(first) == (0, "")
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 2 and all(peek_snapshot(p).signed for p in files)
    forge(folder, read_snapshot_key(key))
    second = run(tiny_gguf, folder, tmp_path / "second", "--snapshot_key", str(key))
    count, note = loaded(second)
    assert count == 1 and "1 unsigned" in note and "removed 1 corrupt" in note
    assert sorted(r > 0 for r in reused(second)) == [False, True]  # the forged prompt ran cold
    assert texts(tmp_path / "second") == texts(tmp_path / "cold")  # nothing poisoned
    assert len(list(folder.glob("*.safetensors"))) == 2  # written again, signed
    third = run(tiny_gguf, folder, tmp_path / "third", "--snapshot_key", str(key))
    assert loaded(third) == (2, "") and texts(tmp_path / "third") == texts(tmp_path / "cold")
    for secret in (key.read_text().strip(),):
        assert secret not in first.stdout + first.stderr + second.stdout + second.stderr


def test_signed_files_do_not_load_without_the_key_or_with_another(tiny_gguf, tmp_path) -> None:
    folder, key = tmp_path / "snapshots", key_file(tmp_path)
    run(tiny_gguf, folder, tmp_path / "a", "--snapshot_key", str(key))
    other = run(tiny_gguf, folder, tmp_path / "b", "--snapshot_key", str(key_file(tmp_path, "other")))
    assert loaded(other)[0] == 0 and "2 bad_signature" in loaded(other)[1]
    keyless = run(tiny_gguf, folder, tmp_path / "c")  # the other key's files were rewritten: signed again
    assert loaded(keyless)[0] == 0 and "2 bad_signature" in loaded(keyless)[1]
    assert texts(tmp_path / "a") == texts(tmp_path / "b") == texts(tmp_path / "c")


def test_snapshot_key_argument_errors(tmp_path, capsys) -> None:
    assert main(["--snapshot_key", "k", "hi"]) == 2
    assert "--snapshot_key needs --snapshot_dir" in capsys.readouterr().err
    loose = tmp_path / "loose"
    loose.write_text(secrets.token_urlsafe(32))
    os.chmod(loose, 0o644)
    short = tmp_path / "short"
    short.write_text("tooshort")
    os.chmod(short, 0o600)
    for path, problem in ((loose, "readable or writable by others"), (short, "at least 32 are needed")):
        argv = [
            "--snapshot_dir",
            str(tmp_path / "d"),
            "--prefix_cache_entries",
            "1",
            "--snapshot_key",
            str(path),
        ]
        assert main([*argv, "hi"]) == 2
        err = capsys.readouterr().err
        assert problem in err and str(path) in err and path.read_text() not in err
