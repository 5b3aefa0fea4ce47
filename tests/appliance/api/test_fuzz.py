"""Schemathesis fuzzes every operation of the app's own OpenAPI schema against the real server,
with a valid token, valid and invalid requests alike: no response may be a 5xx, every response
must conform to the schema (its status, content type, headers and body as documented), and
invalid requests must be refused.

Bounded for CI: a fixed number of examples per operation, derandomized (the same requests on
every run), against an engine with a 96-token context so that no generated request runs long.
`INFERNO_FUZZ_EXAMPLES=N` runs N examples per operation instead (a longer run by hand; with
`--junitxml` the report's `num_cases` property says how many requests were sent).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation import GenerationMode

from appliance.auth.roles import Role
from appliance.engine.engine import Engine
from tests.appliance.api.conftest import (
    MODEL_NAME,
    RunningServer,
    make_settings,
    running_server,
)

EXAMPLES_PER_OPERATION = int(os.environ.get("INFERNO_FUZZ_EXAMPLES", "15"))
CONFORMANCE = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def server(
    smollm2_dir: Path,
    smollm2_engine: Callable[..., Engine],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningServer]:
    engine = smollm2_engine(max_model_len=96, num_kv_blocks=128)
    settings = make_settings(tmp_path_factory.mktemp("tls"), smollm2_dir)
    with running_server(settings, engine) as running:
        yield running


def _narrow_to_served(schemas: dict[str, Any]) -> None:
    """Valid requests that this server can serve, so that generation itself is fuzzed: they
    name the served model (another is answered 404 at once, test_errors covers that), and
    offer no tools, tool calls or tool results (SmolLM2's template has no tool support: refused
    400, test_tool_calls covers that), no field the Responses API refuses by name, no
    whitespace pattern (always refused: JSON is written compactly; test_structured_outputs) and
    no reasoning on messages (only an assistant's may carry one; test_reasoning)."""
    for name in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest"):
        schemas[name]["properties"]["model"]["enum"] = [MODEL_NAME]
    for name, fields in (
        ("ChatCompletionRequest", ("tools", "tool_choice", "audio", "modalities", "prediction",
                                   "reasoning_effort", "service_tier", "web_search_options",
                                   "functions", "function_call", "verbosity",
                                   "prompt_cache_key", "safety_identifier",
                                   "guided_whitespace_pattern")),
        ("CompletionRequest", ("guided_whitespace_pattern",)),
        ("ChatMessage", ("tool_calls", "tool_call_id", "reasoning", "reasoning_content")),
        ("ResponsesRequest", ("tools", "tool_choice", "store", "previous_response_id",
                              "truncation", "include", "reasoning", "background", "conversation",
                              "prompt", "max_tool_calls", "top_logprobs", "prompt_cache_key",
                              "service_tier", "safety_identifier", "metadata")),
    ):  # fmt: skip
        for field in fields:
            del schemas[name]["properties"][field]
    message = schemas["ChatMessage"]
    message["properties"]["role"]["enum"].remove("tool")
    message["required"] = ["role", "content"]
    message["properties"]["content"]["anyOf"].remove({"type": "null"})
    input_ = schemas["ResponsesRequest"]["properties"]["input"]
    # Messages only: a function call's output needs a model with tool support.
    input_["anyOf"][1]["items"] = {"$ref": "#/components/schemas/MessageItem"}


@pytest.mark.slow
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzed_requests_get_no_server_error_and_conform_to_the_schema(
    server: RunningServer, mode: GenerationMode, request: pytest.FixtureRequest
) -> None:
    with server.http() as http:
        openapi = http.get("/openapi.json").json()
    if mode is GenerationMode.POSITIVE:
        _narrow_to_served(openapi["components"]["schemas"])
    schema = schemathesis.openapi.from_dict(openapi)
    checks = list(CONFORMANCE)
    if mode is GenerationMode.NEGATIVE:
        checks.append(negative_data_rejection)
    session = requests.Session()
    user = {"Authorization": f"Bearer {server.token(Role.USER)}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
    }
    statuses: Counter[tuple[str, int]] = Counter()
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not len(operation.body):
            continue  # no body to make invalid (any string is a valid model id)

        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate, Phase.shrink],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def exchange(case: schemathesis.Case) -> None:
            response = case.call(
                base_url=server.url,
                session=session,
                verify=str(server.cert_file),
                timeout=300,  # generous: a loaded 2-core CI machine, up to n x 96 tokens
                headers=user,
            )
            statuses[case.operation.path, response.status_code] += 1
            case.validate_response(response, checks=checks)

        exchange()
    # In a --junitxml report: how many cases a run sent, for a longer run's record. (Not the
    # record_property fixture, which warns under the default junit_family.)
    request.node.user_properties.append(("num_cases", statuses.total()))
    if mode is GenerationMode.POSITIVE:  # generation itself was fuzzed, not only refusals
        assert statuses["/v1/completions", 200] >= 3, statuses
        assert statuses["/v1/chat/completions", 200] >= 3, statuses
        assert statuses["/v1/responses", 200] >= 3, statuses
