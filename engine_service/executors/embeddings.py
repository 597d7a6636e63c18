"""EmbeddingsExecutor: a ModuleExecutor that also prefills precomputed input embeddings; a batch mixing
token and embedding inputs embeds the token rows (``model.embed``) and stays one forward."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engine_service.executors.module import ModuleExecutor
from engine_service.executors.plan import InputError
from engine_service.executors.prepared_input import EmbeddingsInput, PreparedInput


class EmbeddingsExecutor(ModuleExecutor):
    """Accepts :class:`EmbeddingsInput` (by kind identity) besides raw tokens."""

    def accepts(self, prepared: PreparedInput) -> bool:
        return prepared.kind() is EmbeddingsInput.KIND

    def _check_prepared(self, prepared: PreparedInput) -> None:
        if not isinstance(prepared, EmbeddingsInput):  # its kind says embeddings; its class must agree
            raise InputError(
                f"prepared input of kind {prepared.kind()!r} is a {type(prepared).__name__}, "
                "not an EmbeddingsInput"
            )
        hidden = self.config.hidden_size
        if prepared.hidden_size != hidden:
            raise InputError(
                f"EmbeddingsInput hidden size {prepared.hidden_size} != model hidden_size {hidden}"
            )
        # A non-finite row must never be written: in the cell pool other sessions' views may cover its
        # cell under a mask, and a masked weight of 0 times NaN is still NaN.
        if not mx.all(mx.isfinite(prepared.embeddings())).item():
            raise InputError("EmbeddingsInput holds non-finite values (NaN or inf)")

    def _forward(self, step: Any, positions: mx.array, pieces: list, logit_rows: mx.array) -> mx.array:
        if not any(isinstance(plan.rows, EmbeddingsInput) for plan, _, _ in pieces):
            return super()._forward(step, positions, pieces, logit_rows)
        rows = []
        for plan, lo, hi in pieces:
            chunk = plan.piece(lo, hi)
            if isinstance(chunk, EmbeddingsInput):
                rows.append(chunk.embeddings().astype(mx.float32))
            else:
                rows.append(self.model.embed(mx.array(chunk, dtype=mx.int32)))
        embeddings = rows[0] if len(rows) == 1 else mx.concatenate(rows)
        return self.model(step, positions, embeddings=embeddings, logit_rows=logit_rows)
