"""The model's tokenizer and chat template, loaded from a HF-style model directory.

Uses the `tokenizers` library only (no transformers at run time) and renders chat templates the
way transformers' `apply_chat_template(tokenize=False)` does, in jinja2's
`ImmutableSandboxedEnvironment` because a template ships with the model and is untrusted code
(ARCHITECTURE.md, "Engine" → "Embedded default model").
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.defaults
import jinja2.ext
import jinja2.meta
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders

from appliance.engine.errors import InvalidRequestError, ModelLoadError
from appliance.engine.generation_config import GenerationConfig

CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""A chat template beside the tokenizer: it wins over tokenizer_config.json's, as in
transformers."""

MAX_TEMPLATE_KWARGS_BYTES = 4096
"""Largest `chat_template_kwargs` of one request, as compact JSON."""

MAX_TEMPLATE_KWARGS_DEPTH = 4
"""Deepest nesting of objects and arrays in `chat_template_kwargs`."""

# What the server itself gives the template: a request's kwargs may not replace it (the
# conversation, the tools, where the reply starts, the model's special tokens, the functions
# transformers and jinja provide).
RESERVED_TEMPLATE_VARIABLES = frozenset(jinja2.defaults.DEFAULT_NAMESPACE) | frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "raise_exception",
        "strftime_now",
    }
)


class _FailOnUnsafeUndefined(jinja2.Undefined):
    """Lenient like jinja's default `Undefined`, except for blocked attribute accesses.

    Templates routinely test missing keys (`{% if message.tool_calls %}`), so ordinary undefined
    values must stay falsy and print as "" (transformers' behaviour). But the sandbox answers an
    unsafe access such as `''.__class__` with an undefined that would also print as "", hiding the
    attempt; this one fails on any use instead, so a hostile template is refused, not half-run.
    """

    __slots__ = ()

    def _fail_if_unsafe(self) -> None:
        if isinstance(self._undefined_exception, type) and issubclass(
            self._undefined_exception, SecurityError
        ):
            self._fail_with_undefined_error()

    def __str__(self) -> str:
        self._fail_if_unsafe()
        return super().__str__()

    def __bool__(self) -> bool:
        self._fail_if_unsafe()
        return super().__bool__()

    def __iter__(self) -> Any:
        self._fail_if_unsafe()
        return super().__iter__()

    def __len__(self) -> int:
        self._fail_if_unsafe()
        return super().__len__()


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: in a byte-level BPE vocabulary every character
    of a token stands for one byte (printable bytes for themselves, the others shifted past 255)."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    visible += range(ord("®"), ord("ÿ") + 1)
    chars = {b: chr(b) for b in visible}
    hidden = (b for b in range(256) if b not in chars)
    chars.update((b, chr(256 + n)) for n, b in enumerate(hidden))
    return {char: b for b, char in chars.items()}


_BYTE_LEVEL_ALPHABET = _byte_level_alphabet()
# For str.translate: each alphabet character to the Latin-1 character of its byte, and every
# other character below 256 to one Latin-1 cannot encode (characters from 256 up that are not
# in the alphabet stay as they are, which it cannot encode either).
_UNENCODABLE = "\uffff"
_TO_LATIN1 = {code: _UNENCODABLE for code in range(256)} | {
    ord(char): chr(byte) for char, byte in _BYTE_LEVEL_ALPHABET.items()
}


def _byte_level_bytes(token: str) -> bytes | None:
    """The bytes a token spelled wholly in the byte-level alphabet stands for; None for any
    other spelling. (One pass in C: with a model whose tokens spread over the vocabulary, such
    as W3's random one, most tokens are seen here once.)"""
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return None


class _BytePieces(dict[int, bytes]):
    """A byte-level tokenizer's tokens as its decoder turns them into bytes, each looked up
    once, on its first use (a dict: a later lookup is no Python call). As the `tokenizers`
    ByteLevel decoder does: a token spelled wholly in the byte alphabet stands for those bytes,
    any other (an added token such as "héllo wörld") for its UTF-8; the special tokens in
    `skipped` and ids outside the vocabulary for nothing, as `decode` drops them."""

    def __init__(self, backend: BackendTokenizer, skipped: frozenset[str]) -> None:
        super().__init__()
        self._backend = backend
        self._skipped = skipped

    def __missing__(self, token_id: int) -> bytes:
        token = self._backend.id_to_token(token_id)
        if token is None or token in self._skipped:
            data = b""
        else:
            data = _byte_level_bytes(token)
            if data is None:
                data = token.encode()
        self[token_id] = data
        return data


def _raise_template_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers replaces jinja's `tojson`, which HTML-escapes; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format_: str) -> str:
    return datetime.now().strftime(format_)


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile `source` with the environment and globals transformers gives chat templates."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
        undefined=_FailOnUnsafeUndefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _plain_message_data(value: Any) -> Any:
    """`value` rebuilt from exact JSON types, so a template reaches no method of a rich object.

    Raises `InvalidRequestError` for anything that is not JSON data.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        if not all(isinstance(key, str) for key in value):
            raise InvalidRequestError("chat message keys must be strings")
        return {str(key): _plain_message_data(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain_message_data(item) for item in value]
    raise InvalidRequestError(
        f"chat messages may hold only JSON values, not {type(value).__name__}"
    )


class Tokenizer:
    """Text ↔ token ids for one model, plus its chat template.

    Build it with `from_model_dir`. Every method is safe to call from several threads: the
    backend tokenizer is only read.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        add_bos_token: bool,
        chat_template: str | None,
        generation_eos_token_ids: Iterable[int] = (),
        extra_template_tokens: Mapping[str, str] | None = None,
    ) -> None:
        """Wrap `backend`; `bos_token`/`eos_token` must be in its vocabulary when given.

        `generation_eos_token_ids` adds ids that end generation besides `eos_token` (from
        generation_config.json). `extra_template_tokens` (unk_token, pad_token, ...) are passed
        to the chat template along with bos_token and eos_token, as transformers does.
        """
        self._backend = backend
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._add_bos_token = add_bos_token
        self._bos_token_id = self._token_id(bos_token)
        eos_ids = set(generation_eos_token_ids)
        eos_token_id = self._token_id(eos_token)
        if eos_token_id is not None:
            eos_ids.add(eos_token_id)
        self._eos_token_ids = frozenset(eos_ids)
        self._template_tokens = dict(extra_template_tokens or {})
        for name, token in (("bos_token", bos_token), ("eos_token", eos_token)):
            if token is not None:
                self._template_tokens[name] = token
        self._template = _compile_chat_template(chat_template) if chat_template else None
        self._chat_template_source = chat_template or None
        # transformers passes `tools=` to every template; only one that reads it can show them.
        self._template_reads_tools = bool(chat_template) and "tools" in (
            jinja2.meta.find_undeclared_variables(
                ImmutableSandboxedEnvironment().parse(chat_template)
            )
        )
        self._all_special_ids = frozenset(
            token_id
            for token_id, added in backend.get_added_tokens_decoder().items()
            if added.special
        )
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._token_bytes: dict[int, bytes] = {}
        self._byte_pieces: dict[bool, _BytePieces] = {}
        if self._byte_level:
            # `decode` skips special tokens by their text (tokenizers' AddedVocabulary).
            special = frozenset(
                added.content
                for added in backend.get_added_tokens_decoder().values()
                if added.special
            )
            self._byte_pieces = {
                True: _BytePieces(backend, special),
                False: _BytePieces(backend, frozenset()),
            }

    def _token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ModelLoadError(f"special token {token!r} is not in the tokenizer's vocabulary")
        return token_id

    @classmethod
    def from_model_dir(cls, path: Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and, if present, chat_template.jinja (whose
        template wins over tokenizer_config.json's, as in transformers) and
        generation_config.json (its eos ids).

        Raises `ModelLoadError` when a file is missing, not valid, or names unknown tokens.
        """
        path = Path(path)
        try:
            backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises a bare Exception for every failure
            raise ModelLoadError(
                f"cannot load {path / 'tokenizer.json'} ({exc}); the model directory is "
                "incomplete: re-import or re-download the model"
            ) from exc
        config = _read_json(path / "tokenizer_config.json")
        generation = GenerationConfig.from_model_dir(path)
        template_file = path / CHAT_TEMPLATE_FILE
        chat_template = _read_template_file(template_file)
        if chat_template is None:
            template_file = path / "tokenizer_config.json"
            chat_template = _config_template(config.get("chat_template"))
        try:
            return cls(
                backend,
                bos_token=_token_content(config.get("bos_token")),
                eos_token=_token_content(config.get("eos_token")),
                add_bos_token=bool(config.get("add_bos_token", False)),
                chat_template=chat_template,
                generation_eos_token_ids=generation.eos_token_ids,
                extra_template_tokens={
                    name: token
                    for name in ("unk_token", "pad_token")
                    if (token := _token_content(config.get(name))) is not None
                },
            )
        except jinja2.TemplateSyntaxError as exc:
            raise ModelLoadError(
                f"the chat template in {template_file} does not compile "
                f"(line {exc.lineno}: {exc.message}); fix or remove it"
            ) from exc

    @property
    def bos_token_id(self) -> int | None:
        """The id of the beginning-of-sequence token, or None when the model has none."""
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: generation_config's eos ids and the tokenizer's eos."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` describes it, added tokens included (what a
        grammar engine compiles against)."""
        return self._backend.to_str()

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of the special (control) tokens, the ones `skip_special_tokens` drops."""
        return self._all_special_ids

    @property
    def has_chat_template(self) -> bool:
        """Whether the model ships a chat template."""
        return self._template is not None

    @property
    def chat_template(self) -> str | None:
        """The chat template's source, for telling which tool-call format the model writes."""
        return self._chat_template_source

    @property
    def chat_template_reads_tools(self) -> bool:
        """Whether the chat template renders the `tools` it is given (transformers' convention):
        a template that never reads them would silently drop tool definitions."""
        return self._template_reads_tools

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; BOS first only if `add_special_tokens` and the model adds BOS.

        Special-token text in `text` (like "<|im_start|>") maps to its special id, as in
        transformers.
        """
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self._add_bos_token and self._bos_token_id is not None:
            return [self._bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of `ids`; invalid UTF-8 byte sequences decode to U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def byte_pieces(self, *, skip_special_tokens: bool = True) -> Mapping[int, bytes] | None:
        """Each token's bytes as `decode` joins them, for a tokenizer whose `decode(ids)` is
        exactly `b"".join(pieces[i] for i in ids).decode("utf-8", "replace")`: one whose decoder
        is byte-level BPE's alone (GPT-2 style: Llama 3, Qwen2, SmolLM2). None for any other
        (SentencePiece's decoders strip a leading space, word pieces join with spaces).

        Lets a stream be decoded without calling `decode` per token (the detokenizer's fast
        path). Unlike `token_bytes`, special tokens go through the byte alphabet as `decode`
        takes them (or give b"" when skipped). Safe from any thread like every method: a
        token looked up by two at once gets the same bytes.
        """
        if not self._byte_level:
            return None
        return self._byte_pieces[skip_special_tokens]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a token may hold part of a UTF-8 character).

        Exact for byte-level BPE vocabularies (GPT-2 style: Llama 3, Qwen2, SmolLM2) and for
        SentencePiece byte-fallback tokens (`<0xE2>`); SentencePiece word pieces map `▁` to a
        space. Special tokens give their text; an id outside the vocabulary gives b"".
        """
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        token = self._backend.id_to_token(token_id)
        if token is None:
            data = b""
        elif token_id in self._all_special_ids:
            data = token.encode()
        elif self._byte_level and (spelled := _byte_level_bytes(token)) is not None:
            data = spelled
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            data = bytes([int(token[3:5], 16)])
        else:
            data = token.replace("\u2581", " ").encode()
        self._token_bytes[token_id] = data
        return data

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a conversation in the chat template, ready for the assistant's reply.

        The template writes its own BOS, so none is added. Raises like `apply_chat_template`.
        """
        text = self.apply_chat_template(
            messages, add_generation_prompt=True, tools=tools, template_kwargs=template_kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render `messages` with the model's chat template, as transformers' tokenize=False does.

        `tools` (JSON tool definitions, `{"type": "function", "function": {...}}`) are passed to
        the template as `tools`, None when there are none, as transformers passes them.
        `template_kwargs` (a request's `chat_template_kwargs`, such as Qwen3's
        `enable_thinking`) are further template variables: JSON values within
        MAX_TEMPLATE_KWARGS_BYTES and MAX_TEMPLATE_KWARGS_DEPTH, none of them one of
        RESERVED_TEMPLATE_VARIABLES.

        Raises `InvalidRequestError` when the model has no template, the messages are not a list
        of JSON objects with a string "role", the kwargs break a rule above, or the template
        rejects or fails on them. Error messages never quote message content.
        """
        if self._template is None:
            raise InvalidRequestError(
                "this model has no chat template; send a plain completion request instead"
            )
        conversation = self._validated_messages(messages)
        variables = _verified_template_kwargs(template_kwargs or {})
        try:
            return self._template.render(
                **variables,
                messages=conversation,
                tools=None if tools is None else _plain_message_data(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._template_tokens,
            )
        except SecurityError as exc:
            raise InvalidRequestError(
                "the model's chat template attempted an operation the sandbox forbids; "
                "fix the template"
            ) from exc
        except jinja2.TemplateError as exc:
            # The template's own message may quote the conversation, so it is not repeated.
            raise InvalidRequestError(
                "the model's chat template rejected this conversation (check the order of roles "
                "and that every message has the fields the template needs)"
            ) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise InvalidRequestError(
                f"the model's chat template failed on this conversation ({type(exc).__name__}); "
                "check that every message's content is a string"
            ) from exc

    @staticmethod
    def _validated_messages(messages: Any) -> list[dict[str, Any]]:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("chat messages must be a non-empty list")
        conversation = []
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise InvalidRequestError(f"chat message {index} is not an object")
            if not isinstance(message.get("role"), str):
                raise InvalidRequestError(f"chat message {index} has no string 'role'")
            conversation.append(_plain_message_data(message))
        return conversation


def _verified_template_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`kwargs` as plain JSON data, if they keep the rules of `apply_chat_template`; raises
    `InvalidRequestError` (param `chat_template_kwargs`) naming the rule broken."""
    param = "chat_template_kwargs"
    try:
        plain = _plain_message_data(dict(kwargs))
        size = len(json.dumps(plain, separators=(",", ":")))
    except (InvalidRequestError, RecursionError, ValueError):
        raise InvalidRequestError(
            "chat_template_kwargs must hold JSON values only", param=param
        ) from None
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidRequestError(
            f"chat_template_kwargs is larger than {MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON",
            param=param,
        )
    if _depth(plain) > MAX_TEMPLATE_KWARGS_DEPTH:
        raise InvalidRequestError(
            f"chat_template_kwargs is nested deeper than {MAX_TEMPLATE_KWARGS_DEPTH} levels",
            param=param,
        )
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(plain))
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {', '.join(reserved)}: the server gives the "
            "template those (the messages, tools and reply prompt come from the request's own "
            "fields)",
            param=param,
        )
    return plain


def _depth(value: Any) -> int:
    """Nesting depth of plain JSON data (already bounded in size, so recursion is safe)."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _read_template_file(path: Path) -> str | None:
    """The template in `path`, None when there is no such file."""
    if not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path} ({exc}); re-import the model") from exc


def _config_template(value: Any) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or named templates as a list, of
    which this engine uses the default one only."""
    if isinstance(value, str | None):
        return value
    return next(
        (
            entry.get("template")
            for entry in value
            if isinstance(entry, dict) and entry.get("name") == "default"
        ),
        None,
    )


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json states it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(
            f"{path} is missing; the model directory is incomplete: re-import the model"
        )
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path} ({exc}); re-import the model") from exc
    if not isinstance(content, dict):
        raise ModelLoadError(f"{path} is not a JSON object; re-import the model")
    return content
