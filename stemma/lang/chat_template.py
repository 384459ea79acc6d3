"""How system/user/assistant turns are rendered: a text prefix and suffix per role.

Programs open and close turns one at a time (`user_begin()` ... `user_end()`), with model calls in
between, so the template is split into a prefix and a suffix per role:

1. A tokenizer with a chat template: each role's prefix and suffix are read off the template
   itself, by rendering a conversation whose last message is a sentinel and cutting around it
   (after the rendering of the conversation before it). The BOS text is dropped from the prefixes,
   since programs already start with the BOS id. A template that folds the system message into the
   first user turn (as Gemma's does) renders system turns like user turns.
2. No chat template: the plain fallback, `System: {content}\\n`, `User: {content}\\n`,
   `Assistant: {content}\\n`. A tokenizer without a template is a base model's (instruction-tuned
   checkpoints ship theirs), and base models follow this plain format; the default model, Gemma 3
   270M base, does: given Gemma's own `<start_of_turn>` markup it did not emit `<end_of_turn>`
   in our runs and rambled on, while in the plain format its replies end at the line break
   before the next `User:`.

A gen inside an assistant turn also stops at the end of the turn: at the template's end-of-turn
token when it has one (`stop_ids`), else at the start of a new plain turn (`stop`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from stemma.lang.codec import TokenCodec
from stemma.lang.ir import ROLES

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_SENTINEL = "\u2063STEMMA\u2063"


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    roles: Mapping[str, tuple[str, str]]   # role -> (prefix, suffix)
    stop: tuple[str, ...] = ()             # stop strings of a gen inside an assistant turn
    stop_ids: tuple[int, ...] = field(default=())

    def prefix(self, role: str) -> str:
        return self.roles[role][0]

    def suffix(self, role: str) -> str:
        return self.roles[role][1]


PLAIN = ChatTemplate(
    name="plain",
    roles={"system": ("System: ", "\n"), "user": ("User: ", "\n"), "assistant": ("Assistant: ", "\n")},
    stop=("\nUser:", "\nSystem:"))


def for_codec(codec: TokenCodec) -> ChatTemplate:
    """The template of the codec's tokenizer, or the plain fallback."""
    tokenizer = getattr(codec, "tokenizer", None)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return from_tokenizer(tokenizer, codec)
    return PLAIN


# ---- reading a tokenizer's template ----
def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


def _cut(tokenizer: PreTrainedTokenizerBase, before: list[dict[str, str]],
         role: str) -> tuple[str, str] | None:
    """(prefix, suffix) of `role` after the conversation `before`, or None when the template
    refuses it or does not render the message where expected."""
    try:
        head = _render(tokenizer, before)
        full = _render(tokenizer, before + [{"role": role, "content": _SENTINEL}])
    except Exception:  # jinja templates raise their own errors for conversations they refuse
        return None
    if not full.startswith(head) or full.count(_SENTINEL) != 1:
        return None
    prefix, suffix = full[len(head):].split(_SENTINEL)
    return prefix, suffix


def from_tokenizer(tokenizer: PreTrainedTokenizerBase, codec: TokenCodec) -> ChatTemplate:
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    user = _cut(tokenizer, turn, "user") or _cut(tokenizer, [], "user")
    assistant = _cut(tokenizer, turn[:1], "assistant")
    if user is None or assistant is None:
        raise ValueError("the tokenizer's chat template does not render user and assistant turns")
    system = _cut(tokenizer, [], "system") or user
    bos = getattr(tokenizer, "bos_token", None)
    roles = {}
    for role, (prefix, suffix) in zip(ROLES, (system, user, assistant)):
        if bos and prefix.startswith(bos):
            prefix = prefix[len(bos):]
        roles[role] = (prefix, suffix)
    end = codec.encode(assistant[1].strip())
    stop_ids = (end[0],) if end and codec.decode(end[:1]) == "" else ()
    return ChatTemplate(name="tokenizer", roles=roles, stop_ids=stop_ids)
