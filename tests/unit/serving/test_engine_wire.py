"""The engine wire both ways: every api value survives its message and back (no servers)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine_service.api.answers import CloneRefusal, Described, ImportedSnapshot, TakenClone
from engine_service.api.config import GenConfig
from engine_service.api.engine_info import EngineInfo, WindowGeometry
from engine_service.api.errors import ForklineError
from engine_service.api.logprobs import LogprobEntry, TokenLogprob
from engine_service.api.owners import OwnerQuota, OwnerUsage
from engine_service.api.prompts import TextPrompt
from engine_service.api.stream_events import Done, Snapshot, Started, Tokens
from engine_service.serving import engine_wire as wire
from protos import engine_pb2 as pb

EOS = (2, 7)
# float32 on the wire: values it holds exactly
CONFIG = GenConfig(
    max_new_tokens=9,
    temperature=0.5,
    top_p=0.75,
    top_k=3,
    seed=11,
    stop_tokens=(5,),
    prefill_chunk=64,
    prefill_breakpoints=(4, 8),
    top_logprobs=2,
    json_schema='{"type": "object"}',
)


def read_back(request: pb.GenerateRequest) -> GenConfig:
    return wire.gen_config(request.config, EOS, request.capture.breakpoints)


def test_a_gen_config_survives_the_generate_request() -> None:
    assert read_back(wire.generate_request([1, 2], CONFIG)) == CONFIG


@pytest.mark.parametrize(("ignore_eos", "stops"), [(False, EOS), (True, ())])
def test_empty_stop_tokens_mean_the_models_eos_unless_ignored(ignore_eos: bool, stops: tuple) -> None:
    request = wire.generate_request([1], GenConfig(), ignore_eos=ignore_eos)
    assert read_back(request) == GenConfig(stop_tokens=stops)


def test_unset_fields_take_gen_configs_defaults() -> None:
    assert wire.gen_config(pb.GenerationConfig(), EOS) == GenConfig(stop_tokens=EOS)


def test_a_text_prompt_survives_text_input() -> None:
    chat = TextPrompt("", chat=True, messages=(("system", "be brief"), ("user", "hi")))
    plain = TextPrompt("hello", add_special_tokens=True)
    assert [wire.text_prompt(wire.text_input(p)) for p in (chat, plain)] == [chat, plain]
    assert wire.prompt_fields(plain) == {"text": wire.text_input(plain)}
    assert wire.prompt_fields((4, 5)) == {"tokens": pb.TokenIds(ids=[4, 5])}


def test_the_generate_request_carries_every_option() -> None:
    prepared = pb.PreparedInput(kind="embeddings", shape=[1, 2], payload=bytes(8))
    request = wire.generate_request(
        prepared,
        CONFIG,
        session="s",
        prompt_snapshot=True,
        snapshot_owner="keeper",
        keep_session=True,
        close_session=True,
        final_snapshot=True,
    )
    assert (request.WhichOneof("input"), request.prepared) == ("prepared", prepared)
    assert (request.session, request.keep_session, request.close_session) == ("s", True, True)
    capture = request.capture
    assert (capture.prompt_snapshot, list(capture.breakpoints), capture.snapshot_owner) == (
        True,
        [4, 8],
        "keeper",
    )
    assert capture.final_snapshot


@dataclass(frozen=True)
class Call:  # the fields of the gateway's EngineGenerate the wire reads
    session: str
    tokens: tuple[int, ...]
    config: GenConfig
    ignore_eos: bool = False
    prompt_snapshot: bool = False
    close_session: bool = False
    final_snapshot: bool = False
    checkpoint_every: int = 0


def test_the_prefix_services_engine_request() -> None:
    call = Call("s", (1, 2, 3), CONFIG, True, True, True, True, checkpoint_every=16)
    request = wire.engine_request(call, snapshot_owner="prefix")
    assert request == wire.generate_request(
        [1, 2, 3],
        CONFIG,
        ignore_eos=True,
        session="s",
        prompt_snapshot=True,
        snapshot_owner="prefix",
        close_session=True,
        final_snapshot=True,
        checkpoint_every=16,
    )
    assert request.capture.final_snapshot and request.capture.checkpoint_every == 16
    assert list(request.tokens.ids) == [1, 2, 3] and read_back(request) == CONFIG


EVENTS = [
    Started("s", 3, 2),
    Tokens(
        (4, 5), "ab", (TokenLogprob(LogprobEntry(4, -0.5, "a", b"a"), (LogprobEntry(6, -1.5, "c", b"c"),)),)
    ),
    Snapshot("h", 3, "prompt", content_digest=b"d"),
    Snapshot(None, 2, "breakpoint", "below the floor", reason=CloneRefusal.WINDOW),
    Done("length", 3, 1, 2, 5, 0.25, 8.0, 0.5, "e0"),
    Done("stop", 3, 1, 2, 5, 0.25, 8.0, 0.5, "e1", resumes=1, resumed_positions=40, resume_pause_s=0.25),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_an_event_survives_its_message(event) -> None:
    assert wire.event_from_proto(wire.event_message(event)) == event


def test_an_unknown_event_value_is_a_forkline_error() -> None:
    message = wire.event_message(EVENTS[-1])
    message.done.finish_reason = "exploded"
    with pytest.raises(ForklineError, match="unknown done event value"):
        wire.event_from_proto(message)
    with pytest.raises(ForklineError, match="unknown generate event"):
        wire.event_from_proto(pb.GenerateEvent())


def test_engine_info_survives_its_message() -> None:
    info = EngineInfo(
        "i1",
        "fp",
        128,
        256,
        max_sessions=8,
        max_positions=1500,
        kv_bytes_per_position=23040,
        clone_shared_bytes_per_position=2304,
        clone_shared_ring_positions=68,
        model="m",
        cache_kind="batched-sequence",
        architecture="llama",
        eos_token_ids=EOS,
        chat_template=False,
        idle_session_timeout_s=30.0,
        client_quota=OwnerQuota(2, 100),
        persistent_quota=OwnerQuota(4, 400),
        caller=OwnerUsage("alice", False, 1, 10, OwnerQuota(2, 100)),
        resident_sessions=3,
        open_handles=2,
        active_generations=1,
        queued_commands=1,
        window=WindowGeometry(4, 64, True),
        compute_path="kernels",
        slow_path=True,
        draining=True,
        heartbeat_age_s=0.5,
        heartbeat_longest_s=1.5,
        pinned_exports=True,
    )
    assert wire.engine_info(wire.info_message(info)) == info


def test_clone_answers_both_ways() -> None:
    made = wire.clone_response(TakenClone("c", content_digest=b"d"), 5)
    assert (made.session, made.position, made.content_digest) == ("c", 5, b"d")
    assert wire.taken_clone(made) == TakenClone("c")
    refused = wire.clone_response(TakenClone(None, CloneRefusal.WINDOW), 5)
    assert "sliding-window floor" in refused.refusal
    assert wire.taken_clone(refused) == TakenClone(None, CloneRefusal.WINDOW)
    # a reason this side does not know (or none) reads as the boundary refusal
    assert wire.taken_clone(pb.CloneResponse(reason=999)) == TakenClone(None, CloneRefusal.BOUNDARY)
    assert wire.clone_refusal(0) is None and wire.clone_refusal(999) is None


@pytest.mark.parametrize("value", [Described(7, b"d", False), Described(3, None, True)])
def test_a_description_survives_its_message(value: Described) -> None:
    assert wire.described(wire.describe_response(value)) == value


@pytest.mark.parametrize(
    "value",
    [
        ImportedSnapshot("h", positions=9, content_digest=b"d", extra={"k": "v"}),
        ImportedSnapshot(None, "checksum", "bad"),
    ],
)
def test_an_import_survives_its_message(value: ImportedSnapshot) -> None:
    assert wire.imported_snapshot(wire.import_response(value)) == value


@dataclass(frozen=True)
class Exported:
    data: bytes | None
    refusal: CloneRefusal | None = None
    positions: int = 0
    content_digest: bytes | None = None


def test_an_export_travels_in_chunks_with_its_header_first() -> None:
    data = bytes(range(256)) * (wire.CHUNK_BYTES // 128 + 1)  # two full chunks and a part
    chunks = list(wire.snapshot_chunks(Exported(data, positions=9, content_digest=b"d")))
    assert len(chunks) == 3 and b"".join(c.data for c in chunks) == data
    assert (chunks[0].file_bytes, chunks[0].positions, chunks[0].content_digest) == (len(data), 9, b"d")
    assert all(c.file_bytes == 0 and c.positions == 0 for c in chunks[1:])
    assert [c.refusal for c in wire.snapshot_chunks(Exported(None, CloneRefusal.QUOTA))] == ["quota"]
    assert [c.refusal for c in wire.snapshot_chunks(Exported(None))] == ["unsupported"]
