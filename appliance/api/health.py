"""`/live` (the process answers) and `/health` (200 only when the model is loaded and the engine
runs; 503 with the reason otherwise), for load balancers and orchestrators."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from appliance.api.readiness import Readiness
from appliance.api.schemas import HealthResponse

router = APIRouter()


@router.get("/live")
async def live() -> dict[str, str]:
    return {"status": "alive"}


@router.get(
    "/health",
    response_model=HealthResponse,
    responses={503: {"model": HealthResponse, "description": "not ready, with the reason"}},
)
async def health(request: Request) -> JSONResponse:
    readiness: Readiness = request.app.state.readiness
    status, reason = readiness.state()
    body = HealthResponse(status=status, reason=reason).model_dump(exclude_none=True)
    return JSONResponse(body, status_code=200 if status == "ready" else 503)
