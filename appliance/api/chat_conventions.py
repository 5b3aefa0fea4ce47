"""The conventions of the served model's output: the format of its tool calls and of its
reasoning, as vLLM's `--tool-call-parser` and `--reasoning-parser` name them.

Each is `model.tool_parser` / `model.reasoning_parser` when the settings name one (`none`
turns it off), else chosen automatically (`auto`, the default):

- tools: from the chat template, which shows the model the format it must write (an operator's
  `chat_template.jinja` may teach another one than the checkpoint's), else from the
  architecture in config.json: Qwen3 writes Hermes calls, Granite its `<|tool_call|>` array,
  Phi-3/Phi-4-mini `functools[...]` (under vLLM's tool template: Phi-4-mini's own shows none),
  Gemma 4 its `<|tool_call>call:...` notation.
- reasoning: `qwen3` for a template that lets a request switch thinking (`enable_thinking`)
  and closes a thought (`</think>`): Qwen3's hybrid models. `gemma4` for Gemma 4, by its
  architecture: its parser takes an output for reasoning only when it opens Gemma's thought
  channel, so it is safe on every output. A model that always thinks (QwQ,
  Qwen3-*-Thinking-2507) names it in the settings: a parser on a model that does not think
  would take its whole answer for reasoning.

Gemma 4's markers are special tokens, which the usual decode drops: a request parsed with its
formats is decoded with special tokens kept (`keeps_special_tokens`), as vLLM's parsers ask.

gpt-oss is the exception: its harmony format (appliance.api.harmony) is rendered and parsed,
reasoning and calls together, by the harmony library; its conventions are `HARMONY_CONVENTIONS`
and neither setting applies.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from appliance.api.reasoning_parsers import REASONING_PARSERS, ReasoningParser
from appliance.api.tool_parsers import PARSERS, format_of_template

AUTO, NONE = "auto", "none"

HARMONY = "harmony"
"""The tool-call format of gpt-oss: harmony, which appliance.api.harmony parses (with the
model's reasoning) from the output's tokens."""

TOOL_FORMAT_OF_ARCHITECTURE = {
    "Qwen3ForCausalLM": "hermes",
    "Qwen3MoeForCausalLM": "hermes",
    "GraniteForCausalLM": "granite",
    "Phi3ForCausalLM": "phi4_mini_json",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
}
"""The tool-call format of each architecture's instruct checkpoints, when its template shows
none this server recognises."""

REASONING_FORMAT_OF_ARCHITECTURE = {
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
}
"""The reasoning format of architectures whose parser is safe on outputs without a thought."""

# Formats whose markers are special tokens: the output must be decoded with them kept.
_SPECIAL_TOKEN_FORMATS = frozenset({"gemma4"})


@dataclass(frozen=True, slots=True)
class ChatConventions:
    tool_format: str | None  # a key of tool_parsers.PARSERS, or HARMONY; None: no parser
    reasoning_format: str | None  # a key of reasoning_parsers.REASONING_PARSERS; None: none

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the output is decoded with special tokens kept, for a parser to see them."""
        return bool({self.tool_format, self.reasoning_format} & _SPECIAL_TOKEN_FORMATS)

    def reasoning(
        self, template_kwargs: Mapping[str, object], *, constrained: bool
    ) -> Callable[[], ReasoningParser] | None:
        """What makes the parser of one choice's reasoning; None when the output has none to
        parse: the model does not reason, or a grammar `constrained` the whole output
        (structured outputs, forced tool calls), which it does from the first token, so the
        model writes no thought. Thinking is on unless the request's template kwargs turn it
        off (`enable_thinking: false`, as Qwen3's template reads it)."""
        if self.reasoning_format is None or constrained:
            return None
        thinking = template_kwargs.get("enable_thinking") is not False
        return functools.partial(REASONING_PARSERS[self.reasoning_format], thinking=thinking)


HARMONY_CONVENTIONS = ChatConventions(HARMONY, None)


def tool_parser_names() -> tuple[str, ...]:
    """What `model.tool_parser` may say."""
    return (AUTO, NONE, *PARSERS)


def reasoning_parser_names() -> tuple[str, ...]:
    """What `model.reasoning_parser` may say."""
    return (AUTO, NONE, *REASONING_PARSERS)


def choose_conventions(
    architectures: Sequence[str],
    chat_template: str | None,
    *,
    tool_parser: str = AUTO,
    reasoning_parser: str = AUTO,
) -> ChatConventions:
    """The served model's conventions, from its settings (one of `tool_parser_names()` and of
    `reasoning_parser_names()`), its config.json `architectures` and its chat template."""
    template = chat_template or ""
    if tool_parser == AUTO:
        by_architecture = (TOOL_FORMAT_OF_ARCHITECTURE.get(a) for a in architectures)
        tool_format = format_of_template(template) or next(filter(None, by_architecture), None)
    else:
        tool_format = None if tool_parser == NONE else tool_parser
    if reasoning_parser == AUTO:
        thinks = "enable_thinking" in template and "</think>" in template
        by_architecture = (REASONING_FORMAT_OF_ARCHITECTURE.get(a) for a in architectures)
        reasoning_format = "qwen3" if thinks else next(filter(None, by_architecture), None)
    else:
        reasoning_format = None if reasoning_parser == NONE else reasoning_parser
    return ChatConventions(tool_format, reasoning_format)
