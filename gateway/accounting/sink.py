"""The accounting `UsageSink`: queue each attempt's usage event for the ledger, settle its budget.

The pipeline priced the event (`Pipeline.billing_prices`: the catalog's prices valid when the attempt
started), once for every consumer: the ledger bills the cost the spend caps and the other sinks see.
`record` runs on the request path, so it only appends to the queue; the batch writer does the DB work
and `Admission.settle` the shared-state work, both off the request path.
"""

from __future__ import annotations

from gateway.accounting.admission import Admission
from gateway.accounting.events import UsageEvent
from gateway.accounting.queue import UsageQueue


class AccountingSink:
    def __init__(self, queue: UsageQueue, admission: Admission | None = None) -> None:
        self.queue = queue
        self.admission = admission

    def record(self, event: UsageEvent) -> None:
        self.queue.put(event)
        if self.admission is not None:
            self.admission.settle(event)
