"""The sampling defaults of a model's generation_config.json, as users meet them: OpenAI's own
client against the real server, serving SmolLM2 from a model directory whose
generation_config.json states Qwen3-like defaults. A request that leaves a field out gets the
model's value (vLLM's `--generation-config auto`); one that gives it gets its own. The audit
log's record of each request's sampling shows which applied. (The completions API's own
default length, 16, is not bounded by max_new_tokens: only chat's and Responses' are.)"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from appliance.api.models import ServedModel
from appliance.config import ModelSettings
from appliance.engine.engine import Engine
from tests.appliance.api.conftest import MODEL_NAME, RunningServer, make_settings, running_server
from tests.appliance.api.test_audit_trail import AuditDatabase

DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1,
            "max_new_tokens": 5}  # fmt: skip
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm2-generation-defaults")
    for item in smollm2_dir.iterdir():
        if item.name != "generation_config.json":
            (out / item.name).symlink_to(item)
    config = json.loads((smollm2_dir / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**config, **DEFAULTS}))
    return out


@pytest.fixture(scope="module")
def server(
    api_engine: Engine, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    settings = make_settings(tmp_path_factory.mktemp("tls-generation-defaults"), model_dir)
    with running_server(settings, api_engine) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.client()


def _sampled(server: RunningServer, create: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """The response of `create` (a client's `with_raw_response.create`) and the sampling the
    audit log recorded for it, in the entry its `Audit-Entry` header names."""
    raw = create(model=MODEL_NAME, **kwargs)
    _, index, _ = raw.headers["audit-entry"].split(" ")
    return raw.parse(), AuditDatabase(server).entry(int(index))["details"]["sampling"]


def test_a_chat_that_leaves_sampling_out_gets_the_models_defaults(
    server: RunningServer, client: openai.OpenAI
) -> None:
    create = client.chat.completions.with_raw_response.create
    response, sampling = _sampled(server, create, messages=HELLO)
    assert (sampling["temperature"], sampling["top_p"], sampling["top_k"]) == (0.6, 0.95, 20)
    assert sampling["repetition_penalty"] == 1.1
    # max_new_tokens bounds the default length (the context would allow hundreds).
    assert sampling["max_tokens"] == 5
    assert response.usage.completion_tokens <= 5


def test_what_a_request_gives_overrides_the_models_defaults(
    server: RunningServer, client: openai.OpenAI
) -> None:
    _, sampling = _sampled(
        server, client.chat.completions.with_raw_response.create, messages=HELLO,
        temperature=0, max_tokens=2, extra_body={"top_k": 0, "repetition_penalty": 1.0},
    )  # fmt: skip
    assert (sampling["temperature"], sampling["top_k"], sampling["max_tokens"]) == (0.0, 0, 2)
    assert sampling["repetition_penalty"] == 1.0
    assert sampling["top_p"] == 0.95  # left out: still the model's


def test_completions_take_the_defaults_too(server: RunningServer, client: openai.OpenAI) -> None:
    create = client.completions.with_raw_response.create
    _, sampling = _sampled(server, create, prompt="Hello", max_tokens=1)
    assert (sampling["temperature"], sampling["top_p"], sampling["top_k"]) == (0.6, 0.95, 20)


def test_responses_echo_the_sampling_in_force(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL_NAME, input="Hello")
    assert (response.temperature, response.top_p) == (0.6, 0.95)
    assert response.usage is not None and response.usage.output_tokens <= 5
    given = client.responses.create(
        model=MODEL_NAME, input="Hello", temperature=0.2, max_output_tokens=1
    )
    assert (given.temperature, given.top_p) == (0.2, 0.95)


def test_the_start_up_log_states_the_models_defaults(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="appliance.api.models"):
        model = ServedModel.from_settings("m", ModelSettings(dir=model_dir), created=0)
    stated = {name: value for name, value in DEFAULTS.items() if name != "max_new_tokens"}
    assert model.defaults.stated() == {**stated, "max_tokens": 5}
    assert model.architectures == ("LlamaForCausalLM",)  # SmolLM2's config.json
    assert "generation_config.json" in caplog.text and "'temperature': 0.6" in caplog.text
