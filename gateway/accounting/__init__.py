"""Accounting: prices from the catalog, one priced UsageEvent per upstream attempt, the durable usage
queue, the batch writer that lands events in the ledger exactly once, and report queries."""
