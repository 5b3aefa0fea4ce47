"""`/v1/models`: the one model this appliance serves, and the check that a request names it."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from appliance.api.errors import APIError
from appliance.api.schemas import ErrorResponse, ModelCard, ModelList


class ServedModel:
    def __init__(self, name: str, created: int):
        self.card = ModelCard(id=name, created=created)

    def verify(self, requested: str) -> None:
        """Raise the 404 OpenAI answers for a model that is not served here."""
        if requested != self.card.id:
            raise APIError(
                404,
                f"The model `{requested}` does not exist; this server serves `{self.card.id}`",
                param="model",
                code="model_not_found",
            )


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
