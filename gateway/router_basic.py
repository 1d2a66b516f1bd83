"""Model resolution for now: a public model name maps to exactly one configured model entry.

`resolve` is the seam the routing engine replaces: it returns the ordered candidates for a request,
and the caller tries them in order.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.auth import Principal
from gateway.config import Backend, Config, Model
from gateway.errors import ModelNotFound
from gateway.providers import Provider, provider_for


@dataclass(frozen=True, slots=True)
class Target:
    """One place a request can go: the model entry, its backend and that backend's adapter."""

    model: Model
    backend: Backend
    provider: Provider

    @property
    def upstream_model(self) -> str:
        return self.model.upstream_model


class ModelTable:
    def __init__(self, config: Config) -> None:
        self.targets: dict[str, Target] = {}
        for model in config.models:
            backend = config.backend(model.backend)
            self.targets[model.name] = Target(model, backend, provider_for(backend, model))

    def visible_to(self, principal: Principal) -> list[Target]:
        return [target for name, target in self.targets.items() if principal.may_use(name)]

    def resolve(self, name: str, principal: Principal) -> list[Target]:
        target = self.targets.get(name)
        # A model the tenant may not use is reported exactly like one that does not exist.
        if target is None or not principal.may_use(name):
            raise ModelNotFound(
                f"The model `{name}` does not exist or you do not have access to it.", param="model"
            )
        return [target]
