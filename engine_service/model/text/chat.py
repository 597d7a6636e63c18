"""Chat formatting: the model's own Jinja template, or a named format (chatml, llama3, gemma, none)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine_service.api.errors import InvalidArgument

NAMED_FORMATS = {
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    # Gemma has no system role: a system message is sent as a user turn.
    "gemma": (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>"
        "{{ 'model' if m['role'] == 'assistant' else 'user' }}\n{{ m['content'] | trim }}<end_of_turn>\n"
        "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
    "none": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
}


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatFormatter:
    """Renders messages to the model's prompt text: a Jinja chat ``template`` (GGUF / tokenizer_config)
    or a built-in ``name``, in Jinja's immutable sandbox."""

    def __init__(
        self,
        template: str | None = None,
        *,
        name: str | None = None,
        bos_token: str = "",
        eos_token: str = "",
    ) -> None:
        if (template is None) == (name is None):
            raise InvalidArgument("ChatFormatter needs exactly one of template / name")
        if name is not None:
            if name not in NAMED_FORMATS:
                raise InvalidArgument(f"chat format must be one of {', '.join(NAMED_FORMATS)}, got {name!r}")
            template = NAMED_FORMATS[name]
        self.name = name or "model"
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(template or "")
        except TemplateError as exc:
            raise InvalidArgument(f"chat template does not parse: {exc}") from None
        self._bos, self._eos = bos_token, eos_token
        self._missing: str | None = None

    @classmethod
    def missing(cls, model: str) -> ChatFormatter:
        """A base model's formatter: every ``format`` is an InvalidArgument asking for plain text."""
        formatter = cls(name="none")
        formatter.name = "missing"
        formatter._missing = (
            f"{model} has no chat template (a base model): send the prompt as plain text (chat=false)"
        )
        return formatter

    @property
    def available(self) -> bool:
        return self._missing is None

    def format(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        if self._missing is not None:
            raise InvalidArgument(self._missing)
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidArgument(f"messages[{i}] needs string 'role' and 'content'")
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
            )
        except TemplateError as exc:
            raise InvalidArgument(f"chat template failed: {exc}") from None
