"""Incremental chat encoding: the tokens that follow a sampled turn, without re-tokenizing history.

Token in, token out: a conversation's token ids are the first prompt, then alternately
what the model sampled (kept exactly, end-of-turn token included) and the encoding of
the next messages. The chat template decides how those messages look; this module
renders the conversation with and without them and encodes only the difference,
starting right after the end-of-turn token that closed the sampled turn.
"""

from __future__ import annotations

from trace_jax.models.tokenizer import ChatTokenizer


class ChatCodec:
    """Encodes one conversation's first prompt and each continuation for `tokenizer` and `tools`."""

    def __init__(self, tokenizer: ChatTokenizer, tools: list[dict] | None = None):
        self.tokenizer = tokenizer
        self.tools = tools
        self._end_texts = sorted({tokenizer.decode([i]) for i in tokenizer.eos_token_ids}, key=len, reverse=True)
        self._end_id: int | None = None

    def first_prompt(self, messages: list[dict]) -> list[int]:
        """The conversation so far, ready for the model's next turn."""
        return self.tokenizer.apply_chat(messages, tools=self.tools)

    def assistant_turn(self, text: str) -> list[int]:
        """The tokens a model emits for an assistant message `text`: its encoding, then the
        end-of-turn token the chat template closes an assistant turn with."""
        return self.tokenizer.encode(text) + [self._assistant_end_id()]

    def _assistant_end_id(self) -> int:
        """The end-of-turn token the template writes right after an assistant message's content."""
        if self._end_id is None:
            marker = "\x00end\x00"
            text = self.tokenizer.render_chat(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                add_generation_prompt=False,
            )
            after = text[text.rindex(marker) + len(marker) :]
            end = next((e for e in self._end_texts if after.startswith(e)), None)
            if end is None:
                raise ValueError(
                    f"the chat template does not close an assistant turn with an end-of-turn token: {after[:40]!r}"
                )
            self._end_id = self.tokenizer.encode(end)[0]
        return self._end_id

    def continuation(self, history: list[dict], new_messages: list[dict], closed: bool = True) -> list[int]:
        """Tokens after `history` (ending with the model's own turn, as sampled) that add
        `new_messages` and open the model's next turn. A turn cut off before its end-of-turn
        token (`closed=False`) gets that token first.

        Raises ValueError if the template renders `history` differently once messages
        follow it (the incremental encoding would then drift from a full rendering).
        """
        before = self.tokenizer.render_chat(history, tools=self.tools, add_generation_prompt=False)
        after = self.tokenizer.render_chat(history + new_messages, tools=self.tools)
        start, end = self._last_turn_end(before)
        if after[:end] != before[:end]:
            raise ValueError("the chat template re-renders earlier turns when messages are appended")
        return self.tokenizer.encode(after[end if closed else start :])

    def _last_turn_end(self, text: str) -> tuple[int, int]:
        """Where the last end-of-turn token in `text` starts and ends."""
        index, end = max((text.rfind(end), end) for end in self._end_texts)
        if index < 0:
            raise ValueError("the rendered history has no end-of-turn token")
        return index, index + len(end)
