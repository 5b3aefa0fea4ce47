"""Structured outputs in the engine: grammars compiled against the embedded model's tokenizer
(llguidance), masks applied in the batched sampler, outputs that always parse and validate,
also after preemption and recomputation."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import jsonschema
import pytest
import torch

from appliance.engine.engine import Engine
from appliance.engine.errors import InvalidRequestError
from appliance.engine.sampling_params import SamplingParams, StructuredOutput
from appliance.engine.structured_output import TokenMasks

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}

# A varied set: nesting, enums, arrays with bounds, optional and required properties, numbers
# with bounds, booleans, nulls, anyOf, patterns. Strings, arrays and decimals (`multipleOf`) are
# bounded so that every object fits the token budget whatever the sampler picks: a bounded
# number may still have any number of digits, and at temperature 1 a small model writes them.
# (Multiples of 0.25, exact in binary: jsonschema checks multipleOf in floating point.)
SCHEMAS: list[dict[str, object]] = [
    PERSON,
    {
        "type": "object",
        "properties": {
            "status": {"enum": ["open", "closed", "pending"]},
            "priority": {"type": "integer", "minimum": 1, "maximum": 5},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 10},
                "maxItems": 3,
            },
        },
        "required": ["status", "priority"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "order": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {
                        "type": "number",
                        "minimum": 0,
                        "maximum": 1000,
                        "multipleOf": 0.25,
                    },
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
            "express": {"type": "boolean"},
        },
        "required": ["order", "express"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25},
                        "y": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25},
                    },
                    "required": ["x", "y"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 3,
            },
            "label": {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]},
        },
        "required": ["points", "label"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"enum": ["red", "green", "blue"]},
        "minItems": 2,
        "maxItems": 4,
    },
]


@pytest.fixture(scope="module")
def engine(smollm2_engine: Callable[..., Engine]) -> Engine:
    return smollm2_engine(max_model_len=512, num_kv_blocks=1024, max_num_seqs=64)


def _prompt(engine: Engine, text: str) -> list[int]:
    assert engine.tokenizer is not None
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def _schema_params(schema: dict[str, object], **kwargs: object) -> SamplingParams:
    spec = StructuredOutput("json_schema", json.dumps(schema))
    return SamplingParams(**{"max_tokens": 160, "structured": spec, **kwargs})  # type: ignore[arg-type]


@pytest.mark.slow
def test_200_sampled_objects_of_varied_schemas_all_parse_and_validate(
    smollm2_engine: Callable[..., Engine],
) -> None:
    # All 200 in one batch, for the fewest steps (the longest object is some 60 tokens), after
    # a short plain prompt (the chat template's system prompt would make prefill the cost).
    # Sampled from the global generator, seeded: per-request seeds cost a draw per row.
    engine = smollm2_engine(max_model_len=512, num_kv_blocks=1600, max_num_seqs=200)
    assert engine.tokenizer is not None
    prompt = engine.tokenizer.encode("A JSON value:")
    params = [_schema_params(SCHEMAS[i % len(SCHEMAS)], temperature=1.0) for i in range(200)]
    torch.manual_seed(0)
    completions = engine.generate([prompt] * 200, params)
    for i, completion in enumerate(completions):
        assert completion.finish_reason == "stop", (i, completion.text)
        jsonschema.validate(json.loads(completion.text), SCHEMAS[i % len(SCHEMAS)])
    # Sampling explored the schemas rather than repeating one object per schema.
    assert len({c.text for c in completions}) > 150


def test_choice_and_regex_outputs_match_exactly(engine: Engine) -> None:
    prompt = _prompt(engine, "Is the sky blue?")
    choices = ["yes", "no", 'it "depends"\\']
    [choice] = engine.generate(
        [prompt],
        SamplingParams(max_tokens=20, structured=StructuredOutput("choice", json.dumps(choices))),
    )
    assert choice.text in choices and choice.finish_reason == "stop"
    pattern = r"[0-9]{3}-[A-Z]{2}( ok)?"
    outputs = engine.generate(
        [prompt] * 8,
        [
            SamplingParams(
                max_tokens=20,
                temperature=1.0,
                seed=i,
                structured=StructuredOutput("regex", pattern),
            )
            for i in range(8)
        ],
    )
    for output in outputs:
        assert re.fullmatch(pattern, output.text), output.text
        assert output.finish_reason == "stop"


def test_lark_grammar_constrains_the_output(engine: Engine) -> None:
    grammar = 'start: "SELECT " column " FROM " table\ncolumn: "id" | "name"\ntable: "users"'
    [out] = engine.generate(
        [_prompt(engine, "Write SQL.")],
        SamplingParams(max_tokens=30, structured=StructuredOutput("grammar", grammar)),
    )
    assert out.text in ("SELECT id FROM users", "SELECT name FROM users")


def test_structured_and_free_requests_share_a_batch(engine: Engine) -> None:
    """The mask touches only its own rows: an unconstrained greedy request in the same batch
    gets exactly the tokens it gets alone."""
    free_prompt = _prompt(engine, "Say hello.")
    [alone] = engine.generate([free_prompt], SamplingParams(max_tokens=12, temperature=0.0))
    free, constrained = engine.generate(
        [free_prompt, _prompt(engine, "A person as JSON.")],
        [SamplingParams(max_tokens=12, temperature=0.0), _schema_params(PERSON, temperature=0.0)],
    )
    assert free.token_ids == alone.token_ids
    jsonschema.validate(json.loads(constrained.text), PERSON)


def test_outputs_stay_valid_when_requests_are_preempted_and_recomputed(
    smollm2_engine: Callable[..., Engine],
) -> None:
    # Each request needs 5 blocks of 16 tokens by its end (a ~35-token prompt, ~45 tokens of
    # output); 8 blocks admit two at a time, whose growth forces preemptions and recomputation.
    engine = smollm2_engine(max_model_len=256, num_kv_blocks=8, enable_prefix_caching=False)
    numbers = {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 999}}
    schema = {**numbers, "minItems": 10, "maxItems": 10}
    prompt = _prompt(engine, "Ten numbers as a JSON array.")
    params = [_schema_params(schema, temperature=1.0, seed=i, max_tokens=80) for i in range(4)]
    completions = engine.generate([prompt] * 4, params)
    assert engine.stats().num_preemptions > 0
    for completion in completions:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), schema)


def test_compiled_grammars_are_cached_and_copies_are_independent(engine: Engine) -> None:
    compiler = engine.grammars
    assert compiler is not None
    spec = StructuredOutput("regex", "ab|ac")
    before = compiler.compile_times().counts[-1]
    first, second = compiler.grammar(spec), compiler.grammar(spec)
    assert compiler.compile_times().counts[-1] == before + 1  # the second came from the cache
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    [a] = tokenizer.encode("a")
    assert first.accept(a)
    # The second copy has not moved: its mask still allows only what the grammar starts with.
    masks = TokenMasks.for_rows([first, second], engine.vocab_size)
    assert masks is not None
    masks.fill()
    allowed = _allowed(masks.bitmask, engine.vocab_size)
    assert a in allowed[1] and a not in allowed[0]


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (StructuredOutput("regex", "a(b"), "unclosed group"),
        (StructuredOutput("json_schema", '{"$ref": "#/nowhere"}'), "nowhere"),
        (StructuredOutput("json_schema", "{not json"), "JSON"),
        (StructuredOutput("grammar", "start: missing_rule"), "missing_rule"),
    ],
)
def test_a_bad_specification_is_refused_with_its_reason(
    engine: Engine, spec: StructuredOutput, reason: str
) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(reason)) as refused:
        engine.prepare_request("bad", [1, 2, 3], SamplingParams(structured=spec))
    assert refused.value.param == "structured_outputs"


def test_structured_outputs_refuse_ignore_eos_and_min_tokens() -> None:
    spec = StructuredOutput("json_object")
    for field in ({"ignore_eos": True}, {"min_tokens": 2}):
        with pytest.raises(InvalidRequestError, match="not available with structured outputs"):
            SamplingParams(structured=spec, **field)  # type: ignore[arg-type]


def test_mask_puts_minus_infinity_exactly_on_forbidden_tokens(engine: Engine) -> None:
    """Against a plain reference: every row's forbidden tokens become -inf, every other logit
    (and every unconstrained row) keeps its value."""
    compiler = engine.grammars
    assert compiler is not None
    grammars = [
        compiler.grammar(StructuredOutput("regex", "[0-9]+")),
        None,
        compiler.grammar(StructuredOutput("choice", '["yes", "no"]')),
    ]
    masks = TokenMasks.for_rows(grammars, engine.vocab_size)
    assert masks is not None
    masks.fill()
    logits = torch.randn(3, engine.vocab_size)
    masked = masks.apply(logits)
    allowed = _allowed(masks.bitmask, engine.vocab_size)
    for row, grammar_row in ((0, 0), (2, 1)):
        forbidden = torch.ones(engine.vocab_size, dtype=torch.bool)
        forbidden[sorted(allowed[grammar_row])] = False
        assert torch.isneginf(masked[row][forbidden]).all()
        assert torch.equal(masked[row][~forbidden], logits[row][~forbidden])
    assert torch.equal(masked[1], logits[1])
    assert 0 < len(allowed[0]) < engine.vocab_size and len(allowed[1]) >= 2


def _allowed(bitmask: torch.Tensor, vocab_size: int) -> list[set[int]]:
    """The allowed token ids of each row of a bitmask, bit by bit in plain Python."""
    rows = []
    for words in bitmask.tolist():
        rows.append({t for t in range(vocab_size) if (words[t // 32] & 0xFFFFFFFF) >> (t % 32) & 1})
    return rows
