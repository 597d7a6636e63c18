"""The engine wire: every conversion between the engine's messages and ``api`` values, both ways, for
the engine's servicer, its clients and the prefix service. One module per message family."""

from engine_service.serving.engine_wire.answers import (
    CHUNK_BYTES,
    CLONE_REFUSALS,
    clone_refusal,
    clone_response,
    describe_response,
    described,
    import_response,
    imported_snapshot,
    snapshot_chunks,
    taken_clone,
)
from engine_service.serving.engine_wire.config import gen_config, generation_config
from engine_service.serving.engine_wire.events import event_from_proto, event_message
from engine_service.serving.engine_wire.generate import engine_request, generate_request
from engine_service.serving.engine_wire.info import engine_info, info_message
from engine_service.serving.engine_wire.prompts import (
    Prompt,
    prompt_fields,
    text_input,
    text_prompt,
    tokenize_request,
    tokenize_response,
    tokenized,
)

__all__ = [
    "CHUNK_BYTES",
    "CLONE_REFUSALS",
    "Prompt",
    "clone_refusal",
    "clone_response",
    "describe_response",
    "described",
    "engine_info",
    "engine_request",
    "event_from_proto",
    "event_message",
    "gen_config",
    "generate_request",
    "generation_config",
    "import_response",
    "imported_snapshot",
    "info_message",
    "prompt_fields",
    "tokenize_request",
    "tokenize_response",
    "tokenized",
    "snapshot_chunks",
    "taken_clone",
    "text_input",
    "text_prompt",
]
