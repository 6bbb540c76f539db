"""The toy task's routes and its plug-in."""

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from nextstep.service.routes.common import JsonRoute
from nextstep.service.tasks import TaskPlugin

from .service import SPEC, Toy

router = APIRouter(prefix="/v1/toy/{model}", tags=["toy"], route_class=JsonRoute)


async def toy(request: Request) -> Toy:
    return request.app.state.toy


@router.get("/entities/{entity}")
async def entity(model: str, entity: str, service: Annotated[Toy, Depends(toy)]) -> dict:
    return service.answer(model, entity)


TASK = TaskPlugin(SPEC, Toy, router, "toy", build=lambda shared, store: Toy(shared.registry, store, shared.engines),
                  store=lambda settings: {"ttl_seconds": None}, no_migrate="a toy keeps no state")
