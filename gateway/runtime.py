"""Everything a request needs, built once from the config: the model table, the shared transport,
the authenticator, the usage sink, metrics and supervised engines."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec
import structlog

from gateway.auth import (
    Authenticator,
    OpenAuthenticator,
    Principal,
    StaticAuthenticator,
    api_key_from,
    authenticate_known,
)
from gateway.config import Config, tenant_models_outside_the_config
from gateway.engine_supervisor import EngineCollector, EngineProcess, resolve_engine_backend
from gateway.errors import AuthenticationFailed, TooManyFailedKeys
from gateway.limits import RequestLimits
from gateway.metrics import Metrics
from gateway.pipeline import Admission, Pipeline
from gateway.router_basic import ModelTable
from gateway.throttle import FailureThrottle
from gateway.transport import Transport
from gateway.usage_sink import FanoutSink, MetricsSink, UsageSink
from routing.compare import Comparer
from routing.execute import Executor
from routing.health import record_windows
from routing.router import Router
from routing.windows import served_windows

log = structlog.get_logger("weir.gateway")


class Gateway:
    def __init__(
        self,
        config: Config,
        *,
        authenticator: Authenticator | None = None,
        usage_sink: UsageSink | None = None,
        admission: Admission | None = None,
    ) -> None:
        # Engines without a URL are started here; every engine is then reached at its OpenAI base URL.
        self.engines = [
            EngineProcess(b) for b in config.backends if b.type == "engine" and not (b.url or b.base_url)
        ]
        backends = [resolve_engine_backend(b) if b.type == "engine" else b for b in config.backends]
        self.config = config = msgspec.structs.replace(config, backends=backends)
        self.metrics = Metrics()
        self.metrics.registry.register(EngineCollector(self.engines))
        self.transport = Transport()
        self.models = ModelTable(config)
        self.router = Router(
            self.models, config.routes, registry=self.metrics.registry, difficulty_head=config.difficulty_head
        )
        if authenticator is None:
            if config.tenants is None:
                authenticator = OpenAuthenticator()
            else:
                authenticator = StaticAuthenticator(config.tenants)
        self.authenticator = authenticator
        self.auth_throttle = FailureThrottle(config.server.auth_failures_per_minute)
        sinks: list[UsageSink] = [MetricsSink(self.metrics), self.router.stats]
        if usage_sink is not None:
            sinks.append(usage_sink)
        self.sink = sinks[0] if len(sinks) == 1 else FanoutSink(sinks)
        self.limits = RequestLimits(config)  # messages per request, concurrent streams per tenant
        self.pipeline = Pipeline(
            self.transport,
            self.sink,
            self.metrics,
            config.models,
            self.limits.admission(admission),
            self.router.context.loads,
        )
        self.executor = Executor(
            self.pipeline,
            self.router.breakers,
            self.router.context,
            self.router.metrics,
        )
        for engine in self.engines:
            engine.on_models = self._engine_windows(engine.backend.name)
        supervised = {engine.backend.name: engine for engine in self.engines}
        self.pipeline.given_up = lambda backend: e.given_up if (e := supervised.get(backend)) else None
        self.comparer = Comparer(
            self.pipeline,
            self.models,
            self.router.context,
            lambda principal: self.limits.policy(principal).store_prompts,
            self.metrics.registry,
            in_force=self.router.in_force,
        )
        # What the gateway keeps per route name goes with the route (deleted or renamed), and a
        # request still running then does not bring it back.
        self.router.listeners += [lambda _, gone: self.metrics.forget_models(gone), self.comparer.forget]
        self.metrics.in_force = self.router.in_force
        self.started = False

    def _engine_windows(self, backend: str) -> Callable[[bytes], None]:
        """What a supervised engine's model list says of its context window, for the executor."""

        def record(body: bytes) -> None:
            windows = served_windows(body, sole=True)
            if windows is not None:
                record_windows(self.router.windows, backend, windows)

        return record

    async def start(self) -> None:
        # Only where nothing checks keys: with the admin DB, a config without tenants still needs one
        if isinstance(self.authenticator, OpenAuthenticator):
            log.warning("no_tenants_configured", detail="every request is accepted without an API key")
        for engine in self.engines:
            await engine.start()
        await self.router.start(self.transport)
        # A config tenant's `models` may name a route of the admin DB, which the loader cannot see
        # (gateway.config.tenant_models_outside_the_config): said here, now that the DB's routes are
        # in force, not refused, since an admin may create it at any time and every replica then
        # serves it within a second.
        for where, name in tenant_models_outside_the_config(self.config):
            if not self.router.in_force(name):
                log.warning(
                    "tenant_model_not_served",
                    at=where,
                    model=name,
                    detail="no model or route of that name in the config or the admin DB: the tenant's "
                    "requests for it answer 404 model_not_found until a route of that name is created",
                )
        self.started = True

    async def stop(self) -> None:
        self.started = False
        await self.comparer.stop()
        # The usage events of attempts still waiting for their answers' bodies (`Pipeline.exchange`):
        # those of requests and comparisons just cancelled too, before the transport closes.
        await self.pipeline.background.drain()
        await self.router.stop()
        for engine in self.engines:
            await engine.stop()
        await self.transport.close()

    @property
    def readiness(self) -> str:
        """What /readyz says: "starting" until the replica can serve what it was started for (every
        supervised engine healthy once or given up on, the difficulty classifier the routes need
        loaded), then "ready", or while it can answer nothing (`answers_something`) "failed" where an
        engine could not load its model (it is not started again), else "unavailable"."""
        if (
            not self.started
            or self.router.scorer_loading
            or not all(e.loaded or e.failed for e in self.engines)
        ):
            return "starting"
        if self.answers_something():
            return "ready"
        return "failed" if any(e.failed for e in self.engines) else "unavailable"

    def answers_something(self) -> bool:
        """Whether some model is served by a backend other than a supervised engine, or by one that is
        up. An engine restarting does not take the replica out of the pool while it has another
        backend: its routes fail over at once, and the same input crashing every replica's engine must
        not take every replica out. One whose models all sit on engines that are down answers nothing,
        so it leaves, and the replicas whose engines are up take its share."""
        healthy = {engine.backend.name: engine.healthy for engine in self.engines}
        return not healthy or any(healthy.get(t.backend.name, True) for t in self.models.targets.values())

    async def authenticate(self, headers: Mapping[str, str], address: str = "unknown") -> Principal:
        """The caller of the request's key; `address` (gateway.throttle.client_address) is throttled
        after too many wrong keys: each unknown key costs the admin DB a query."""
        api_key = api_key_from(headers)
        if api_key is not None:
            # Keys known without a DB query pass, over the allowance or not: a real client with a
            # typo in one request keeps its real key. Asked first, so that the throttle (a Redis
            # round trip when shared) is asked only of keys that would reach the DB.
            principal = await authenticate_known(self.authenticator, api_key)
            if principal is not None:
                return principal
            wait = await self.auth_throttle.retry_after(address)
            if wait is not None:  # over its allowance: a spray of random keys stops reaching the DB
                raise TooManyFailedKeys(
                    "Too many requests with an incorrect API key from this address. "
                    f"Retry in {wait} seconds.",
                    headers={"retry-after": str(wait)},
                )
        principal = await self.authenticator.authenticate(api_key or "")
        if principal is None:
            if api_key is None:
                raise AuthenticationFailed(
                    "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' or as 'x-api-key'."
                )
            await self.auth_throttle.failed(address)
            raise AuthenticationFailed("Incorrect API key provided.")
        return principal
