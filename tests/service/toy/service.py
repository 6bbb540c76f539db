"""The toy task's service: its spec (artifacts with a manifest and nothing else) and an entity's version."""

from nextstep.service.core import StatefulTask
from nextstep.service.registry import TaskSpec, register_task

SPEC = register_task(TaskSpec("toy", (), None, False, lambda name, manifest, graphs, fail, inside: {}))


class Toy(StatefulTask):
    TASK, PREFIX = SPEC.name, "toy"

    def answer(self, name: str, entity: str) -> dict:
        model = self.model(name, entity)
        return {"model": model.name, "version": model.version, "entity": entity}
