"""TextPrompt: a prompt as text, which the engine tokenizes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextPrompt:
    """Plain ``text`` (with the tokenizer's special tokens when ``add_special_tokens``), or with
    ``chat`` the chat template's rendering of [``system``] + user ``text`` -- or, when ``messages``
    holds (role, content) pairs, of that whole conversation -- with the generation prompt."""

    text: str
    chat: bool = False
    system: str = ""
    add_special_tokens: bool = False
    messages: tuple[tuple[str, str], ...] = ()

    def conversation(self) -> tuple[tuple[str, str], ...]:
        """The (role, content) messages a chat prompt renders ((): not a chat prompt). The one
        conversation rule: ``messages`` when given, else [``system``] + user ``text``."""
        if not self.chat:
            return ()
        if self.messages:
            return tuple(self.messages)
        return ((("system", self.system),) if self.system else ()) + (("user", self.text),)


@dataclass(frozen=True)
class Tokenized:
    """A text prompt's ``ids`` and, for a chat prompt when asked, ``message_ends``: ascending positions
    in (0, len(ids)) where one of its latest messages (the last excepted) ends."""

    ids: tuple[int, ...]
    message_ends: tuple[int, ...] = ()
