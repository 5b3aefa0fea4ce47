"""Schemathesis fuzzes every operation of the app's own OpenAPI schema against the real server:
valid and invalid requests alike, no response may be a 5xx, every status must be documented, and
invalid requests must be refused.

Bounded for CI: a fixed number of examples per operation, derandomized (the same requests on
every run), against an engine with a 96-token context so that no generated request runs long.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import (
    negative_data_rejection,
    not_a_server_error,
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

EXAMPLES_PER_OPERATION = 15


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


@pytest.mark.slow
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzed_requests_get_no_server_error_and_only_documented_statuses(
    server: RunningServer, mode: GenerationMode
) -> None:
    with server.http() as http:
        openapi = http.get("/openapi.json").json()
    if mode is GenerationMode.POSITIVE:
        # A random model name is answered 404 at once (test_errors covers that): valid
        # requests name the served model, so that generation itself is fuzzed.
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            openapi["components"]["schemas"][name]["properties"]["model"]["enum"] = [MODEL_NAME]
    schema = schemathesis.openapi.from_dict(openapi)
    checks = [not_a_server_error, status_code_conformance]
    if mode is GenerationMode.NEGATIVE:
        checks.append(negative_data_rejection)
    session = requests.Session()
    user = {"Authorization": f"Bearer {server.token(Role.USER)}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions"}
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
                timeout=60,
                headers=user,
            )
            statuses[case.operation.path, response.status_code] += 1
            case.validate_response(response, checks=checks)

        exchange()
    if mode is GenerationMode.POSITIVE:  # generation itself was fuzzed, not only refusals
        assert statuses["/v1/completions", 200] >= 3, statuses
        assert statuses["/v1/chat/completions", 200] >= 3, statuses
