"""`/v1/models`: the one model this appliance serves, and the check that a request names it;
what the API must know of that model besides its engine: the conventions of its output
(appliance.api.chat_conventions), gpt-oss's harmony format (appliance.api.harmony) and the
sampling defaults of its generation_config.json."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from appliance.api.chat_conventions import (
    AUTO,
    HARMONY_CONVENTIONS,
    ChatConventions,
    choose_conventions,
)
from appliance.api.errors import APIError
from appliance.api.harmony import HarmonyFormat
from appliance.api.schemas import ErrorResponse, ModelCard, ModelList
from appliance.config import ModelSettings
from appliance.engine.errors import ModelLoadError
from appliance.engine.generation_config import GenerationConfig, SamplingDefaults
from appliance.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

NO_DEFAULTS = SamplingDefaults()


class ServedModel:
    def __init__(
        self,
        name: str,
        created: int,
        *,
        architectures: Sequence[str] = (),
        defaults: SamplingDefaults = NO_DEFAULTS,
        tool_parser: str = AUTO,
        reasoning_parser: str = AUTO,
        harmony: HarmonyFormat | None = None,
    ):
        self.card = ModelCard(id=name, created=created)
        self.architectures = tuple(architectures)
        self.defaults = defaults
        self._tool_parser = tool_parser
        self._reasoning_parser = reasoning_parser
        # gpt-oss's chat format: its conversations are rendered and its output parsed by the
        # harmony library rather than through a chat template and text parsers.
        self.harmony = harmony

    @classmethod
    def from_settings(cls, name: str, settings: ModelSettings, created: int) -> ServedModel:
        """The model of `settings`, its architectures read from config.json and its sampling
        defaults from generation_config.json (files a sealed model keeps in the clear); for
        gpt-oss, the harmony library's encoding. Raises `ModelLoadError` for a
        generation_config.json this server cannot use, and for gpt-oss when the harmony library
        cannot serve it or a parser setting that cannot apply is given."""
        defaults = GenerationConfig.from_model_dir(settings.dir).defaults
        architectures = config_architectures(settings.dir / "config.json")
        harmony = HarmonyFormat.of_model(architectures)
        if harmony is not None:
            _verify_harmony_settings(settings)
        if defaults.stated():
            # As vLLM says it: a request that leaves these out gets the model's values.
            logger.info("sampling defaults from the model's generation_config.json: %s",
                        defaults.stated())  # fmt: skip
        return cls(
            name,
            created,
            architectures=architectures,
            defaults=defaults,
            tool_parser=settings.tool_parser,
            reasoning_parser=settings.reasoning_parser,
            harmony=harmony,
        )

    def conventions(self, tokenizer: Tokenizer) -> ChatConventions:
        """The formats of the model's tool calls and reasoning (appliance.api.chat_conventions)."""
        if self.harmony is not None:
            return HARMONY_CONVENTIONS
        return choose_conventions(
            self.architectures,
            tokenizer.chat_template,
            tool_parser=self._tool_parser,
            reasoning_parser=self._reasoning_parser,
        )

    def verify(self, requested: str) -> None:
        """Raise the 404 OpenAI answers for a model that is not served here."""
        if requested != self.card.id:
            raise APIError(
                404,
                f"The model `{requested}` does not exist; this server serves `{self.card.id}`",
                param="model",
                code="model_not_found",
            )


def _verify_harmony_settings(settings: ModelSettings) -> None:
    """gpt-oss writes harmony, which the harmony library parses: a parser setting other than
    `auto` would name a format the model does not write, so it is refused, not ignored."""
    for field in ("tool_parser", "reasoning_parser"):
        value = getattr(settings, field)
        if value != AUTO:
            raise ModelLoadError(
                f"model.{field} is {value!r}, but gpt-oss writes the harmony format, whose "
                "reasoning and tool calls the harmony library parses: leave model.tool_parser "
                "and model.reasoning_parser at 'auto'"
            )


def config_architectures(config_file: Path) -> tuple[str, ...]:
    """config.json's `architectures` (none when absent); the loader validates the rest."""
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {config_file} ({exc}); re-import the model") from exc
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if architectures is None:
        return ()
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ModelLoadError(f"{config_file}: architectures must be a list of names")
    return tuple(architectures)


async def _served_model(request: Request) -> ServedModel:
    return request.app.state.served_model


Model = Annotated[ServedModel, Depends(_served_model)]

router = APIRouter()


@router.get("/v1/models")
async def list_models(model: Model) -> ModelList:
    return ModelList(data=[model.card])


@router.get("/v1/models/{model_id}", responses={404: {"model": ErrorResponse}})
async def retrieve_model(model_id: str, model: Model) -> ModelCard:
    model.verify(model_id)
    return model.card
