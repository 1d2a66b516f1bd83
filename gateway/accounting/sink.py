"""The accounting `UsageSink`: price each attempt from the catalog, queue it, settle its budget.

`record` runs on the request path, so it only prices in memory and appends to the queue; the batch
writer does the DB work and `Admission.settle` the shared-state work, both off the request path.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from gateway.accounting.admission import Admission
from gateway.accounting.events import UsageEvent
from gateway.accounting.pricing import PriceCatalog, sheet_of
from gateway.accounting.queue import UsageQueue


class AccountingSink:
    def __init__(
        self, queue: UsageQueue, catalog: Callable[[], PriceCatalog], admission: Admission | None = None
    ) -> None:
        self.queue = queue
        self._catalog = catalog
        self.admission = admission
        # (catalog prices, event prices) last found to price alike: the catalog's dicts and a
        # config sheet's are shared and never modified, so the same two objects price alike again.
        self._same: tuple[object, object] = (None, None)

    def record(self, event: UsageEvent) -> None:
        # The catalog (prices valid when the attempt started) wins over the price the caller computed
        # from its config; without a catalog row the caller's price stands.
        prices = self._catalog().prices_at(event.backend, event.model, event.ts)
        if prices:
            if prices is self._same[0] and event.prices is self._same[1]:
                # The pair found equal last time (both dicts are shared and never modified).
                self._queue_and_settle(event)
                return
            sheet = sheet_of(prices)
            if sheet.prices is event.prices or sheet.prices == event.prices:
                # The caller priced it with the same prices (its config seeds the catalog): the cost
                # is the same, so the event stands as it is (no second pricing, no copy).
                self._same = (prices, event.prices)
                self._queue_and_settle(event)
                return
            cost = sheet.price(event.usage)
            event = msgspec.structs.replace(
                event,
                prices=cost.prices,
                cost_pico_usd=cost.cost_pico_usd,
                savings_pico_usd=cost.savings_pico_usd,
            )
        self._queue_and_settle(event)

    def _queue_and_settle(self, event: UsageEvent) -> None:
        self.queue.put(event)
        if self.admission is not None:
            self.admission.settle(event)
