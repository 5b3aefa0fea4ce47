"""llguidance against xgrammar on the host, as structured outputs use them: how long a JSON
schema takes to compile against a tokenizer, its first mask, each later mask of a valid output,
and a batch of 64 masks at once (W2's concurrency), on the same tokenizer and schemas.

    pip install xgrammar llguidance transformers   # xgrammar needs transformers' tokenizer
    python bench/grammar_engines.py TOKENIZER_JSON

Only llguidance is a dependency of the appliance (docs/BENCHMARKS.md, "Grammar engines", says
why); this script is how the choice was measured.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

from tokenizers import Tokenizer

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "qty": {"type": "integer", "minimum": 1},
                    },
                    "required": ["sku", "qty"],
                },
                "minItems": 1,
                "maxItems": 5,
            },
            "status": {"enum": ["open", "closed", "pending"]},
        },
        "required": ["items", "status"],
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
                        "required": ["c"],
                    }
                },
                "required": ["b"],
            },
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["a"],
    },
]
INSTANCES = [
    {"name": "Ada Lovelace", "age": 36},
    {"items": [{"sku": "ABC-1234", "qty": 3}, {"sku": "XYZ-0001", "qty": 1}], "status": "pending"},
    {"a": {"b": {"c": 1.25}}, "tags": ["x", "hello world", "z"]},
]
ANY_JSON = {
    "title": "A quarterly report on the appliance",
    "summary": "Revenue grew by 12 percent; the board approved the budget for next year.",
    "scores": [1, 2.5, -300.0],
    "nested": {"ok": True, "none": None},
}
BATCH = 64


def walk(fill: Callable[[], None], accept: Callable[[int], bool], ids: list[int]) -> list[float]:
    """Time each mask along a valid output; returns seconds per mask."""
    times = []
    for token in ids:
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
        assert accept(token), token
    return times


def row(name: str, compile_s: float, masks: list[float]) -> str:
    return (
        f"| {name} | {compile_s * 1e3:.1f} ms | {masks[0] * 1e3:.2f} ms | "
        f"{statistics.median(masks[1:]) * 1e6:.1f} µs | {max(masks[1:]) * 1e6:.0f} µs |"
    )


def main() -> None:
    path = sys.argv[1]
    with open(path) as f:
        text = f.read()
    backend = Tokenizer.from_str(text)
    vocab = backend.get_vocab_size(with_added_tokens=True)
    outputs = [
        backend.encode(json.dumps(i, separators=(",", ":")), add_special_tokens=False).ids
        for i in INSTANCES
    ]
    any_ids = backend.encode(
        json.dumps(ANY_JSON, separators=(",", ":")), add_special_tokens=False
    ).ids
    rows = ["| engine, schema | compile | first mask | later masks (median) | later (max) |"]
    rows.append("|---|---|---|---|---|")

    import llguidance
    import llguidance.torch as lgt

    start = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab)
    rows.append(f"| llguidance tokenizer | {(time.perf_counter() - start) * 1e3:.0f} ms | | | |")
    bitmask = lgt.allocate_token_bitmask(BATCH, vocab)
    compact = {"whitespace_flexible": False}
    for n, (schema, ids) in enumerate(zip(SCHEMAS, outputs, strict=True)):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=compact)
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        compile_s = time.perf_counter() - start
        masks = walk(lambda m=matcher: lgt.fill_next_token_bitmask(m, bitmask, 0),
                     matcher.consume_token, ids)  # fmt: skip
        rows.append(row(f"llguidance, schema {n + 1}", compile_s, masks))
    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
    matchers = [llguidance.LLMatcher(tokenizer, grammar) for _ in range(BATCH)]
    executor = llguidance.LLExecutor()
    pairs = [(m, i) for i, m in enumerate(matchers)]
    batch_times = walk(
        lambda: lgt.fill_next_token_bitmask_par(executor, pairs, bitmask),
        lambda t: all(m.consume_token(t) for m in matchers),
        any_ids,
    )
    rows.append(row(f"llguidance, any JSON, batch of {BATCH}", 0.0, batch_times))

    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_file=path), vocab_size=vocab
    )
    compiler = xgr.GrammarCompiler(info)
    rows.append(f"| xgrammar tokenizer | {(time.perf_counter() - start) * 1e3:.0f} ms | | | |")
    xmask = xgr.allocate_token_bitmask(BATCH, vocab)
    for n, (schema, ids) in enumerate(zip(SCHEMAS, outputs, strict=True)):
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )
        matcher = xgr.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - start
        masks = walk(lambda m=matcher: m.fill_next_token_bitmask(xmask, 0), matcher.accept_token,
                     ids)  # fmt: skip
        rows.append(row(f"xgrammar, schema {n + 1}", compile_s, masks))
    compiled = compiler.compile_builtin_json_grammar()
    xmatchers = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    batched = xgr.BatchGrammarMatcher()
    batch_times = walk(
        lambda: batched.batch_fill_next_token_bitmask(xmatchers, xmask),
        lambda t: all(m.accept_token(t) for m in xmatchers),
        any_ids,
    )
    rows.append(row(f"xgrammar, any JSON, batch of {BATCH}", 0.0, batch_times))
    print(f"tokenizer {path}: {vocab} tokens")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
