"""Request and response bodies of the OpenAI-compatible API, one model per direction.

Field names, defaults and shapes follow OpenAI's API reference for `/v1/completions` and
`/v1/chat/completions`. Requests forbid unknown fields (as OpenAI does: "Unrecognized request
argument"), so a misspelt parameter is an error rather than silently ignored, and take each
field in its own JSON type only (strict: `"5"` is no number). `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos` and `cache_salt` are
extensions (named as in vLLM). Streamed chunks are typed in `appliance.api.streaming`, beside
the writer that keeps their per-token cost low.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)

from appliance.engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
)

MAX_CHOICES = 16
"""Largest `n` one request may ask for."""

MAX_STOP_STRINGS = 16

MAX_MESSAGES = 1024
"""Most messages one chat request may hold (each is rendered through the chat template)."""


def _unicode(value: str) -> str:
    """JSON can spell a lone UTF-16 surrogate (`"\\ud800"`), which is no Unicode text: refuse
    it here, by name, rather than fail in the tokenizer or the audit log's commitment."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"contains an unpaired UTF-16 surrogate at character {exc.start}: not valid Unicode"
        ) from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]
TokenId = Annotated[int, Field(ge=0)]
NonEmptyText = Annotated[Text, Field(min_length=1)]


def _judged_whole(why: str) -> WrapValidator:
    """For an object keyed by the client: any error inside it is reported at the object itself,
    saying `why`, since an error's location would otherwise quote a key (the client's text)."""

    def validate(value: object, handler: ValidatorFunctionWrapHandler) -> object:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(why) from None

    return WrapValidator(validate)


def _token_id_keys(value: dict[str, float]) -> dict[str, float]:
    if any(not (key.isascii() and key.isdecimal()) or len(key) > 10 for key in value):
        raise ValueError("a key is no token id")
    return value


# OpenAI's `logit_bias`: token ids, as decimal strings (JSON keys are strings), to biases.
LogitBias = Annotated[
    dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
    Field(max_length=MAX_LOGIT_BIAS, description="token id (a decimal string) -> logit bias"),
    AfterValidator(_token_id_keys),
    _judged_whole(
        f"must map at most {MAX_LOGIT_BIAS} token ids, each a decimal integer string, to "
        "numbers in [-100, 100]"
    ),
]

MAX_METADATA_PAIRS = 16

# OpenAI's bounds on `metadata`.
Metadata = Annotated[
    dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]],
    Field(max_length=MAX_METADATA_PAIRS),
    _judged_whole(
        f"must be an object of at most {MAX_METADATA_PAIRS} texts, keys up to 64 characters "
        "and values up to 512"
    ),
]


class _Request(BaseModel):
    # Strict: a number is a JSON number and a flag a JSON boolean; `"5"` or `true` for
    # max_tokens is refused, not converted (a float field still takes an integer: JSON has one
    # number type, and OpenAI's client sends `temperature: 0`).
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    # Absent: any JSON object. Applied whether `strict` or not: the grammar always holds.
    schema_: dict[str, object] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_fits_type(self) -> ResponseFormat:
        if (self.json_schema is None) != (self.type != "json_schema"):
            raise ValueError("json_schema: given with, and only with, type 'json_schema'")
        return self


MAX_CHOICE_STRINGS = 256
"""Most strings a `choice` structured output may list."""


class StructuredOutputsParams(_Request):
    """vLLM's `structured_outputs` extension: exactly one of json, regex, choice, grammar and
    json_object (appliance.api.structured_outputs)."""

    json_: dict[str, object] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICE_STRINGS)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    # Accepted with the only behaviour there is: compact JSON, no fallback engine.
    disable_any_whitespace: bool | None = None
    disable_fallback: bool | None = None
    # Refused by name (appliance.api.structured_outputs).
    whitespace_pattern: object = None
    disable_additional_properties: object = None
    structural_tag: object = None


_MODEL_DEFAULT = "default: the model's generation_config.json, else "


class SamplingFields(_Request):
    """Fields both endpoints share."""

    model: str
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: (
        NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOP_STRINGS)] | None
    ) = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Left out (or null): the model's generation_config.json value, else the one in brackets
    # (appliance.engine.generation_config), as vLLM's `--generation-config auto` does.
    temperature: float | None = Field(
        default=None, ge=0.0, le=2.0, description=_MODEL_DEFAULT + "1"
    )
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description=_MODEL_DEFAULT + "1")
    frequency_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    presence_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: LogitBias | None = None
    user: Text | None = Field(default=None, description="an end-user id; accepted and unused")
    top_k: int | None = Field(
        default=None,
        ge=0,
        description="extension: sample from the k most likely (0: all); " + _MODEL_DEFAULT + "0",
    )
    min_p: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="extension: min-p sampling; " + _MODEL_DEFAULT + "0",
    )
    repetition_penalty: float | None = Field(
        default=None,
        gt=0.0,
        allow_inf_nan=False,
        description="extension (vLLM): divide the positive logits (multiply the negative ones) "
        "of tokens of the prompt or the output by this; 1 disables it; " + _MODEL_DEFAULT + "1",
    )
    min_tokens: int = Field(
        default=0, ge=0, description="extension: no EOS or stop token before this many tokens"
    )
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        default=None, description="extension: token ids that end the output (not included)"
    )
    ignore_eos: bool = Field(default=False, description="extension: go on past end-of-sequence")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = Field(
        default=None, description="extension (vLLM): constrain the output to a structure"
    )
    # vLLM's older names for structured_outputs' fields.
    guided_json: dict[str, object] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: (
        Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICE_STRINGS)] | None
    ) = None
    guided_grammar: Text | None = None
    guided_decoding_backend: Text | None = Field(
        default=None, description="accepted and unused: llguidance compiles every grammar"
    )
    guided_whitespace_pattern: object = None
    cache_salt: NonEmptyText | None = Field(
        default=None,
        description="extension (vLLM): share cached prefixes only with requests of the same "
        "salt, within the caller's isolation domain",
    )


class CompletionRequest(SamplingFields):
    # A text, a batch of texts, token ids, or a batch of token-id lists.
    prompt: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    max_tokens: int = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = Field(default=None, description="not supported: must be absent")
    best_of: int | None = Field(default=None, ge=1, description="only 1 is supported")


class TextContentPart(_Request):
    type: Literal["text"]
    text: Text


# Tool calling (OpenAI's function tools): the definitions a request offers the model and the
# calls an assistant message made. Bounds and rendering live in appliance.api.tools.

MAX_TOOLS = 64
"""Most tools one request may define: each is rendered into the prompt."""

MAX_TOOL_CALLS = 16
"""Most tool calls one assistant message may carry."""

# OpenAI's rule for function names.
ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
ToolCallId = Annotated[Text, Field(min_length=1, max_length=256)]


class FunctionDefinition(_Request):
    name: ToolName
    description: Text | None = None
    # A JSON schema; its size and depth are bounded in appliance.api.tools.
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class FunctionTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class CalledFunction(_Request):
    name: ToolName
    arguments: Text  # a JSON object, as text (OpenAI's shape)


class ToolCall(_Request):
    id: ToolCallId
    type: Literal["function"]
    function: CalledFunction


class ToolChoiceFunction(_Request):
    name: ToolName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatMessage(_Request):
    # "developer" is OpenAI's newer name for "system"; the chat template gets "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Absent or null only for an assistant message that carries tool calls.
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: ToolCallId | None = None  # which call a `tool` message answers
    refusal: None = None  # what OpenAI's client sends back of an assistant message it got
    # An assistant's thought, sent back (vLLM's field, and its older name, both accepted).
    reasoning: Text | None = None
    reasoning_content: Text | None = None

    @model_validator(mode="after")
    def _fields_fit_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries tool calls")
        if (self.reasoning, self.reasoning_content) != (None, None) and self.role != "assistant":
            raise ValueError("reasoning: only an assistant message carries reasoning")
        if None not in (self.reasoning, self.reasoning_content) and (
            self.reasoning != self.reasoning_content
        ):
            raise ValueError("reasoning and reasoning_content are two names of one field: give one")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError(
                "tool_call_id: a tool message, and only one, names the call it answers"
            )
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: only an assistant message with tool_calls may have none")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: int | None = Field(default=None, ge=1, description="older name of the next")
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    store: bool | None = Field(default=None, description="only false: nothing is stored")
    metadata: Metadata | None = Field(
        default=None, description="accepted for stored completions; unused, never logged"
    )
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, object] | None = Field(
        default=None,
        description="extension (vLLM): further variables of the chat template, such as "
        "Qwen3's enable_thinking; JSON values, bounded in size and depth, none of the "
        "variables the server sets itself (appliance.engine.tokenizer)",
    )
    # Standard fields this server does not honour: refused by name, with the reason
    # (appliance.api.chat, `_REFUSED`), rather than as unrecognized.
    audio: object = None
    modalities: object = None
    prediction: object = None
    reasoning_effort: object = None
    service_tier: object = None
    web_search_options: object = None
    functions: object = None
    function_call: object = None
    verbosity: object = None
    prompt_cache_key: object = None
    safety_identifier: object = None


# Responses.


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    # The model's thought, apart from its answer (vLLM's field); left out when it has none.
    reasoning: str | None = Field(default=None, exclude_if=lambda reasoning: reasoning is None)
    # Left out when the model called no tool, as OpenAI leaves it out.
    tool_calls: list[ToolCallOut] | None = Field(default=None, exclude_if=lambda calls: not calls)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "inferno"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class HealthResponse(BaseModel):
    status: Literal["ready", "loading", "failed", "stopped", "draining"]
    reason: str | None = None
