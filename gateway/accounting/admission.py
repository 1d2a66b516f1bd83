"""Admission: rate limits and budgets, checked before a request goes upstream, settled after.

RPM and TPM limits (per tenant and per key) are counted in the shared state; TPM counts an estimate
at admission and is corrected to the real token count when the usage event arrives (tokens the
estimate was over by are given back in the bucket it was counted in, see `Admission._apply`). Budgets reserve
the estimated cost at admission and settle to the actual cost per attempt, so concurrent requests can
overspend by at most what is in flight, never more.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

from gateway.accounting.events import UsageEvent
from gateway.accounting.money import MAX_BUDGET_MICRO, format_usd, micro_to_pico, micro_to_usd, pico_to_usd
from gateway.accounting.pricing import LongContextSheet, PriceCatalog, sheet_of
from gateway.aio import detached
from gateway.errors import GatewayError
from gateway.estimate import DEFAULT_OUTPUT_ESTIMATE, DEFAULT_WEB_SEARCH_ESTIMATE
from gateway.ids import exchange_key
from gateway.state import Adjustment, Budget, Limit, Settlement, SharedState, correction_bucket
from gateway.state import Admission as Decision
from gateway.state.base import LATE_SETTLE_S

log = logging.getLogger(__name__)

RESERVATION_TTL_S = 600.0  # a reservation never settled (crashed replica, lost event) frees itself
# Leases: with a large limit, a replica that has to ask the shared state anyway also asks for room for
# about LEASE_REQUESTS more requests like this one (at most 1/LEASE_SHARE of the limit), counted there
# at once; its next requests are then admitted here without a round trip until the lease runs out or
# its bucket (one second) ends, when the unused rest is handed back to that bucket. Budgets likewise
# reserve a pool of money for POOL_TTL_S. The state grants neither unless the window (the budget)
# stays at most half used with it, so near a limit every request is still decided there, one by one:
# never more than the limit is admitted, and a lease can only keep another replica from the last
# units for the rest of its second. Limits below LEASE_SHARE units never lease.
LEASE_REQUESTS = 32
# A lease used up before its bucket ends asks for twice as much next time, up to this many requests'
# worth (and never beyond 1/LEASE_SHARE of the limit); one that ends more than half unused, half.
MAX_LEASE_REQUESTS = 1024
LEASE_WAITS = 3  # how many in-flight asks a request waits for before asking the shared state itself
LEASE_SHARE = 100
POOL_TTL_S = 1.0
LEASE_MARGIN_S = 0.002  # stop using a lease this long before its bucket ends
# How long a request whose exchange is never reported over (`finish`) is remembered: a safety net
# only, since every exchange is reported (the HTTP middleware, a comparison's call), and forgotten
# FINISHED_GRACE_S after. It must outlast the longest exchange, whose attempts settle against it: a
# stream runs as long as chunks keep coming, a whole answer up to its `first_byte` timeout (at most a
# day). It was 15 minutes: a longer exchange settled nothing, so its cost never reached its budget.
PENDING_TTL_S = 24 * 3600.0
# After its HTTP exchange ends, a request is forgotten this much later: attempts still in flight then
# (a cancelled hedge) settle in time, and memory holds seconds of traffic, not PENDING_TTL_S of it.
# Every attempt normally settles before the exchange ends (routing cancels and awaits a losing hedge
# before it returns); the grace covers one whose cancellation is still running. It was 60 s: at
# ~1,500 requests/s that kept ~90,000 requests (tens of MB touched at random) and the SQLite
# gateway's CPU per request was ~5% higher than with 5 s (docs/benchmarks.md).
FINISHED_GRACE_S = 10.0
MAX_PLANS = 10_000  # callers whose limit keys are remembered (forgotten all at once beyond this)
EXPIRE_EVERY_S = 0.5  # how often admissions look for finished requests to forget


@dataclass(frozen=True, slots=True)
class Quotas:
    """The limits that apply to one caller; None means unlimited."""

    tenant_id: str
    key_id: str | None
    tenant_rpm: int | None = None
    tenant_tpm: int | None = None
    tenant_budget_micro_usd: int | None = None
    key_rpm: int | None = None
    key_tpm: int | None = None
    key_budget_micro_usd: int | None = None


@dataclass(slots=True)
class _Pending:
    """A request admitted and not yet settled. At its first settlement it becomes a `_Settled`."""

    reservation_id: str | None
    budget_keys: tuple[str, ...]
    tpm_keys: tuple[str, ...]
    estimated_tokens: int
    created: float = field(default_factory=time.monotonic)
    # Per budget key: (reservation, amount) to release at the first settlement; empty: all of
    # `reservation_id`. Set when the money came from a pool or was reserved along with one. (A
    # tuple by default: no list made per request on the in-process path, which never sets it.)
    releases: Sequence[tuple[str, int]] = ()
    # A failed attempt settled and left the reservation held for what follows it (see settle): the
    # end of the exchange gives it back if no attempt answered.
    held_after_failure: bool = False
    # The exchange is over (`finish`): nothing follows a failed attempt settling now, so it releases.
    finished: bool = False
    # The bucket its token estimate was counted in (the state's numbering): what the estimate was
    # over by is given back there, not in the bucket current at settlement (see _apply). None: the
    # state did not say.
    tpm_bucket: int | None = None


# What a request keeps after its first settlement, for its later attempts (retries, fallbacks,
# hedges): (created, budget keys, token-limit keys), a tuple of immutable values that the plan's
# tuples are shared into. The collector stops tracking such tuples, so the minute of finished
# requests kept (FINISHED_GRACE_S) adds nothing to full collections. Kept as `_Pending` objects
# (each with a list) they were most of a busy gateway's heap: ~44,000 at ~700 requests/s, and
# full collections took ~9% of the worker's CPU (docs/benchmarks.md).
_Settled = tuple[float, tuple[str, ...], tuple[str, ...]]


@dataclass(slots=True)
class _Plan:
    """One caller's limits and budgets for one month (see Admission._plan)."""

    month_index: int  # year * 12 + month
    rates: list[tuple[Limit, bool]]  # (limit, counts tokens: its cost is each request's estimate)
    tpm_keys: tuple[str, ...]
    # Index in `rates` of the first token limit (-1: none). A request's token limits are counted in
    # one call with one window length, so in one bucket: that one's, as the state reports it.
    tpm_index: int
    budgets: list[tuple[Budget, str, str]]  # (budget, scope, owner)
    budget_keys: tuple[str, ...]
    # The Budgets alone, and whether each has been seeded from the ledger: no per-request list and
    # seeding check once all are.
    budget_list: list[Budget] = field(default_factory=list)
    seeded: bool = False
    # The limits of the last request, for the next one with the same token estimate (most of a
    # caller's requests): no Limit objects built per request then. Never modified once built.
    estimate: int = -1
    limits: list[Limit] = field(default_factory=list)


@dataclass(slots=True)
class _Lease:
    units: int
    bucket: int
    window_s: float
    expires: float  # monotonic
    granted: int = 0  # units leased in all (for sizing the next lease)
    # What the state said of the window with the lease (Decision.windows): the units it holds, the
    # whole lease included, and when (monotonic) all of them have left it. The rate-limit headers of
    # the requests admitted from the lease.
    used: int = 0
    emptied_at: float = 0.0


@dataclass(slots=True)
class _Pool:
    reservation_id: str
    left: int
    expires: float  # monotonic
    granted: int = 0


class RateLimited(GatewayError):
    status = 429
    type = "requests"
    code = "rate_limit_exceeded"


class QuotaExceeded(GatewayError):
    status = 429
    type = "insufficient_quota"
    code = "insufficient_quota"


class BudgetUnconfirmed(GatewayError):
    """Refused by this replica's share of a budget while the shared state (Redis) is away: the
    tenant has money left, which no replica can confirm then. A 429 with retry-after that clients
    retry (a retry may reach another replica), not `insufficient_quota`, which they do not."""

    status = 429
    type = "budget_unconfirmed"
    code = "budget_unconfirmed"


# Seconds a request refused by this replica's share of a budget is told to wait (BudgetUnconfirmed):
# enough for a client to land on another replica, or for Redis to answer again after a blip.
BUDGET_UNCONFIRMED_RETRY_S = 2


def _scope(key: str) -> str:
    return "key" if ":key:" in key else "tenant"


def reset_text(seconds: float) -> str:
    """A duration as OpenAI writes its x-ratelimit-reset-* headers: "20ms", "1.5s", "6m0s"."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms = divmod(ms, 60_000)
    whole, frac = divmod(ms, 1000)
    secs = f"{whole}.{frac:03d}".rstrip("0") if frac else str(whole)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


# (limit key, limit, units its window holds, seconds until they have all left it)
WindowState = tuple[str, int, int, float]


def reset_at(seconds: float, now: float | None = None) -> str:
    """When a window empties as Anthropic writes its anthropic-ratelimit-*-reset headers: an RFC 3339
    UTC timestamp in whole seconds, rounded up so that a client waiting for it finds the window
    empty. `now`: the wall clock (time.time()) the duration counts from."""
    at = math.ceil((time.time() if now is None else now) + max(0.0, seconds))
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# Each kind's header names (limit, remaining, reset), made once rather than for every response.
_OPENAI_RATE_HEADERS = {
    kind: (f"x-ratelimit-limit-{kind}", f"x-ratelimit-remaining-{kind}", f"x-ratelimit-reset-{kind}")
    for kind in ("requests", "tokens")
}
_ANTHROPIC_RATE_HEADERS = {
    kind: (
        f"anthropic-ratelimit-{kind}-limit",
        f"anthropic-ratelimit-{kind}-remaining",
        f"anthropic-ratelimit-{kind}-reset",
    )
    for kind in ("requests", "tokens")
}


def rate_headers(windows: Sequence[WindowState], anthropic: bool = False) -> dict[str, str]:
    """OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens} headers: for each kind, the
    limit (tenant's or key's) with the least room left. Reset is when the window will hold nothing
    of what it holds now, OpenAI's "resets to its initial state"; remaining counts units a replica
    leased ahead as used (Admission.leases). `anthropic`: Anthropic's anthropic-ratelimit-{requests,
    tokens}-{limit,remaining,reset} too, of the same limits (reset: `reset_at`). Not its
    input-tokens and output-tokens variants: Weir's TPM counts both together, and a client reading
    the one number as two separate allowances would plan for twice what is left."""
    least: dict[str, tuple[int, int, float]] = {}
    for key, limit, used, reset_s in windows:
        kind = "tokens" if key.startswith("tpm:") else "requests"
        remaining = max(0, limit - used)
        held = least.get(kind)
        if held is None or remaining < held[1]:
            least[kind] = (limit, remaining, reset_s)
    headers = {}
    now = time.time() if anthropic else 0.0
    for kind, (limit, remaining, reset_s) in least.items():
        limit_text, remaining_text = str(limit), str(remaining)
        limit_name, remaining_name, reset_name = _OPENAI_RATE_HEADERS[kind]
        headers[limit_name] = limit_text
        headers[remaining_name] = remaining_text
        headers[reset_name] = reset_text(reset_s)
        if anthropic:
            limit_name, remaining_name, reset_name = _ANTHROPIC_RATE_HEADERS[kind]
            headers[limit_name] = limit_text
            headers[remaining_name] = remaining_text
            headers[reset_name] = reset_at(reset_s, now)
    return headers


def refusal(
    decision: Decision, limits: Sequence[Limit], budgets: Sequence[Budget], amount: int, web_searches: int = 0
) -> GatewayError:
    """What a request the shared state refused is told. First a limit or whole budget its estimate
    alone is over, which no wait can lift: still a 429, as OpenAI answers such a request ("Request too
    large for ... on tokens per min"), so that clients handling OpenAI's keep working, but with no
    retry-after and with `x-should-retry: false`, which the OpenAI and Anthropic SDKs obey before the
    status (a 429 alone they retry, twice by default: in vain, and with the retry-after of 60 s it
    had, for two minutes). A budget its spend leaves no room in is told the same header; one held
    only by requests in flight, and a rate limit, which lift, are not."""
    never = {"x-should-retry": "false"}
    for limit in limits:
        if limit.cost > limit.limit:
            scope = _scope(limit.key)
            if limit.key.startswith("tpm:"):
                return RateLimited(
                    f"Request too large for this {scope} on tokens per min (TPM): Limit {limit.limit}, "
                    f"Requested {limit.cost}. The input or output tokens must be reduced in order to run "
                    "successfully (a request counts its prompt at about 4 bytes a token, and its "
                    f"max_tokens, {DEFAULT_OUTPUT_ESTIMATE} when unset, for each choice it asks for).",
                    type="tokens",
                    headers=never,
                )
            return RateLimited(
                f"This {scope}'s limit is {limit.limit} requests per minute: no request can be admitted. "
                "Ask your Weir administrator to raise it.",
                headers=never,
            )
    for budget in budgets:
        if amount > budget.limit_pico_usd:
            scope = _scope(budget.key)
            searches = (
                f", the web search tool's max_uses ({DEFAULT_WEB_SEARCH_ESTIMATE} when unset)"
                if web_searches
                else ""
            )
            return QuotaExceeded(
                f"Request too large for this {scope}'s monthly budget: its estimated cost (USD "
                f"{format_usd(pico_to_usd(amount))}) is more than this {scope}'s whole monthly budget "
                f"(USD {format_usd(pico_to_usd(budget.limit_pico_usd))}). Reduce the input or max_tokens "
                f"({DEFAULT_OUTPUT_ESTIMATE} when unset){searches}, or ask your Weir administrator to raise "
                "the budget.",
                headers=never,
            )
    if decision.unseeded:
        # The shared state lost the budget again after it was seeded again (Redis restarted or
        # failed over meanwhile): what it has spent is not known this moment, nothing was counted,
        # and the next request seeds it again. Said as what it is, not as a rate limit.
        scope, wait = _scope(decision.unseeded[0]), BUDGET_UNCONFIRMED_RETRY_S
        return BudgetUnconfirmed(
            f"This {scope}'s monthly budget cannot be confirmed: Weir's shared state lost it and is "
            f"restoring it from the ledger. Please try again in {wait}s.",
            headers={"retry-after": str(wait)},
        )
    blocked = decision.blocked_by or ""
    scope = _scope(blocked)
    if blocked.startswith("budget:") and decision.share_spent:
        wait = BUDGET_UNCONFIRMED_RETRY_S
        return BudgetUnconfirmed(
            f"This {scope}'s monthly budget cannot be confirmed across Weir's replicas while their shared "
            f"state is unavailable, and this replica has used its share of it. Please try again in {wait}s: "
            "another replica may admit the request.",
            headers={"retry-after": str(wait)},
        )
    if blocked.startswith("budget:"):
        if _held_in_flight(decision, budgets, amount):
            # Requests in flight reserve what is left; they settle for what they cost (usually less
            # than their estimate), so a retry may fit once they finish: the SDKs' own retries.
            return QuotaExceeded(
                f"This {scope}'s monthly budget has no room for this request while its requests in "
                "flight hold what is left of it. Please try again when they have finished."
            )
        # Spent: no wait lifts it before the month turns or an administrator raises it, so the SDKs
        # are told not to retry it (OpenAI's own insufficient_quota), unlike a rate limit's 429.
        return QuotaExceeded(
            f"You exceeded this {scope}'s monthly budget. Ask your Weir administrator to raise it.",
            headers=never,
        )
    wait = max(1, math.ceil(decision.retry_after_s))
    kind = "tokens" if blocked.startswith("tpm:") else "requests"
    what = "token counting requests" if blocked.startswith("rpm:count:") else kind
    return RateLimited(
        f"Rate limit reached for this {scope} on {what} per minute. Please try again in {wait}s.",
        type=kind,
        headers={"retry-after": str(wait)},
    )


def _counting_limits(plan: _Plan) -> list[Limit]:
    """The limits a token count (`count_tokens`) is admitted under: the caller's RPM limits, each on a
    window of its own (`rpm:count:<scope>:<owner>`), as Anthropic limits its token counting apart from
    Messages; no TPM and no budget, since a count generates nothing and no vendor bills it."""
    return [Limit("rpm:count:" + limit.key[4:], limit.limit) for limit, tpm in plan.rates if not tpm]


def _refused_windows(decision: Decision, limits: Sequence[Limit]) -> list[WindowState]:
    """The windows a refusal's rate-limit headers say: the limit that refused, as it stands (the
    others were not looked at); a budget's refusal, every limit as it stands (nothing was counted),
    as a tenant with RPM/TPM limits reads on every other answer."""
    by = next((limit for limit in limits if limit.key == decision.blocked_by), None)
    if by is not None:
        return [(by.key, by.limit, used, reset_s) for used, reset_s in decision.windows[:1]]
    return [
        (limit.key, limit.limit, used, reset_s)
        for limit, (used, reset_s) in zip(limits, decision.windows, strict=False)
    ]


def _held_in_flight(decision: Decision, budgets: Sequence[Budget], amount: int) -> bool:
    """Whether the budget that refused would take the request but for what requests in flight have
    reserved (`decision.spent`: its settled spend, as the state reports it). Not known: spent."""
    for i, budget in enumerate(budgets):
        if budget.key == decision.blocked_by:
            return i < len(decision.spent) and decision.spent[i] + amount <= budget.limit_pico_usd
    return False


# Spend this month so far, from the ledger: (scope "tenant"|"key", id, month start, usage event ids,
# the least event id of the recent ones) -> (pico-USD, those of the event ids, and of the owner's
# events with an id from the least one on, whose cost it holds), all read at one moment of the ledger.
SpendLookup = Callable[[str, str, dt.date, Sequence[str], str], Awaitable[tuple[int, Collection[str]]]]
# Times a seed reads the ledger again when attempts keep settling on the budget meanwhile.
SEED_TRIES = 5


def month_of(now: dt.datetime) -> str:
    return f"{now.year:04d}-{now.month:02d}"


def _bounded_budget(scope: str, owner: str, limit_micro_usd: int) -> int:
    """A budget as admission counts it: at most MAX_BUDGET_MICRO, which the admin API enforces. One
    stored before that bound (up to 2^63-1 micro-dollars) overflowed its 64-bit pico-dollar counter in
    Redis, and every request of its tenant failed; it is now held to the bound."""
    if limit_micro_usd <= MAX_BUDGET_MICRO:
        return limit_micro_usd
    log.warning(
        "the %s %s's monthly budget (USD %s) is above the most a budget can be; counted as USD %s",
        scope,
        owner,
        format_usd(micro_to_usd(limit_micro_usd)),
        format_usd(micro_to_usd(MAX_BUDGET_MICRO)),
    )
    return MAX_BUDGET_MICRO


def budget_key(scope: str, owner: str, month: str) -> str:
    """A budget's key in the shared state. Its counters are pico-dollars, and the name says so:
    earlier gateways counted whole micro-dollars under `budget:<scope>:...`, and old and new replicas
    sharing one Redis during a rolling upgrade must keep separate counters rather than add up
    numbers in two units (docs/deploy.md)."""
    return f"budget:pico:{scope}:{owner}:{month}"


class Admission:
    def __init__(
        self,
        state: SharedState,
        catalog: Callable[[], PriceCatalog],
        spend: SpendLookup | None = None,
        leasing: bool = False,
    ) -> None:
        self.state = state
        self._catalog = catalog
        self._spend = spend
        self._seeded: set[str] = set()
        self._seed_locks: dict[str, asyncio.Lock] = {}
        self._plans: dict[Quotas, _Plan] = {}
        self._pending: OrderedDict[str, _Pending | _Settled] = OrderedDict()
        # Finished requests, oldest first: when, and which (two deques of floats and strings, not one
        # of tuples: no object the collector tracks is kept per request for FINISHED_GRACE_S).
        self._finished_at: deque[float] = deque()
        self._finished: deque[str] = deque()
        self._next_expiry = 0.0  # monotonic time of the next look for requests to forget
        self._settlements: list[Settlement] = []
        # Token-limit corrections not yet flushed, per (key, bucket; None: the current one).
        self._tpm_deltas: dict[tuple[str, int | None], int] = {}
        self._flusher: asyncio.Task[None] | None = None
        # An in-process state (no Redis) admits and settles synchronously: each attempt at once,
        # without a coroutine, a lock, a task or the batching that a round trip to Redis is worth.
        self._admit_now: Callable[..., Decision] | None = getattr(state, "admit_now", None)
        self._settle_attempt: Callable[..., dict[str, tuple[int, int]]] | None = getattr(
            state, "settle_attempt", None
        )
        # Tenant budgets seen by this replica (budget key -> (tenant id, limit in pico-USD)) and the
        # share of each used, spent plus reserved, as of the last settlement (for /metrics and alerts).
        self._tenant_budgets: dict[str, tuple[str, int]] = {}
        self._budget_usage_ratio: dict[str, float] = {}
        self._month_index = 0  # the latest month a plan was built for (year * 12 + month)
        self._budget_usage_now: Callable[[str], tuple[int, int] | None] | None = getattr(
            state, "budget_usage_now", None
        )
        self.leasing = leasing
        self._leases: dict[str, _Lease] = {}
        self._pools: dict[str, _Pool] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        # Keys whose lease (pool) request is in flight -> set when its answer is in.
        self._asking: dict[str, asyncio.Event] = {}
        # Per key: requests' worth to lease next time (LEASE_REQUESTS unless traffic needs more).
        self._scale: dict[str, int] = {}
        self.local_admissions = 0  # admitted from leases, without a round trip

    def _plan(self, quotas: Quotas, now: dt.datetime) -> _Plan:
        """What `quotas` count, as keys: built once per caller and month, not per request."""
        plan = self._plans.get(quotas)
        # Compared as one integer: formatting the month's name on every request showed in profiles.
        month_index = now.year * 12 + now.month
        if plan is not None and plan.month_index == month_index:
            return plan
        month = month_of(now)
        if month_index > self._month_index:
            self._turn_month(month_index, month)
        rates: list[tuple[Limit, bool]] = []
        tpm_keys: list[str] = []
        for scope, owner, rpm, tpm in (
            ("tenant", quotas.tenant_id, quotas.tenant_rpm, quotas.tenant_tpm),
            ("key", quotas.key_id, quotas.key_rpm, quotas.key_tpm),
        ):
            if owner is None:
                continue
            if rpm is not None:
                rates.append((Limit(f"rpm:{scope}:{owner}", rpm), False))
            if tpm is not None:
                rates.append((Limit(f"tpm:{scope}:{owner}", tpm), True))
                tpm_keys.append(f"tpm:{scope}:{owner}")
        budgets: list[tuple[Budget, str, str]] = []
        for scope, owner, limit in (
            ("tenant", quotas.tenant_id, quotas.tenant_budget_micro_usd),
            ("key", quotas.key_id, quotas.key_budget_micro_usd),
        ):
            if owner is not None and limit is not None:
                key = budget_key(scope, owner, month)
                limit_pico_usd = micro_to_pico(_bounded_budget(scope, owner, limit))
                # Seeded from the ledger before use (`_seed`), when there is one: a state that then
                # holds no seed lost it and says so (`unseeded`).
                budgets.append((Budget(key, limit_pico_usd, seeded=self._spend is not None), scope, owner))
                if scope == "tenant":
                    self._tenant_budgets[key] = (owner, limit_pico_usd)
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        plan = self._plans[quotas] = _Plan(
            month_index,
            rates,
            tuple(tpm_keys),
            next((i for i, (_, tpm) in enumerate(rates) if tpm), -1),
            budgets,
            tuple(b.key for b, _, _ in budgets),
            budget_list=[b for b, _, _ in budgets],
            seeded=self._spend is None,
        )
        return plan

    def _turn_month(self, month_index: int, month: str) -> None:
        """A new month's first plan: what was kept per budget of the months before (seeded keys,
        tenant budgets, their use for /metrics) is never read again, so it goes. Kept, it grew by
        every budget of every month for as long as the replica ran, and last month's use of a
        tenant's budget stayed on /metrics (where its alert fired) as if it were this month's."""
        self._month_index = month_index
        current = f":{month}"
        self._seeded = {key for key in self._seeded if key.endswith(current)}
        for key in [key for key in self._seed_locks if not key.endswith(current)]:
            del self._seed_locks[key]
        self._tenant_budgets = {k: v for k, v in self._tenant_budgets.items() if k.endswith(current)}
        self._budget_usage_ratio = {}
        forget_budgets = getattr(self.state, "forget_budgets", None)  # an in-process state's
        if forget_budgets is not None:
            forget_budgets(lambda key: not key.startswith("budget:") or key.endswith(current))

    async def admit(
        self,
        request_id: str,
        quotas: Quotas,
        backend: str,
        model: str,
        prompt_tokens: int,
        max_output_tokens: int,
        long_context: LongContextSheet | None = None,
        service_tier: str | None = None,
        anthropic: bool = False,
        web_searches: int = 0,
        counting: bool = False,
    ) -> dict[str, str]:
        """Raise RateLimited, QuotaExceeded or BudgetUnconfirmed (429), or count the request in and remember it; the
        rate-limit headers its response carries (`rate_headers`; none without RPM/TPM limits), and
        a 429's: Anthropic's too where `anthropic` (a request to the Messages API).
        `long_context`: the model's long-context tier, which prices the estimate of a long prompt.
        `service_tier`: the tier the request asks for, whose prices (where the model has some) price
        the estimate, as they will bill the attempt: at the base price a priority request was
        reserved too little until it settled, and a tenant near its budget overspent it.
        `web_searches`: the web searches it may run (`gateway.estimate.web_search_estimate`), priced
        into the estimate as they will bill the attempt: left out, a tenant near its budget started a
        request of 50 searches ($0.50) reserved for its tokens alone.
        `counting`: a token count (`count_tokens`), which generates nothing and which the vendors do
        not bill (Anthropic's is free and rate limited apart from Messages): counted on RPM windows
        of its own (`_counting_limits`), never on TPM or a budget."""
        self._expire()
        # Remembered under this exchange's key: a client may send its request id on other requests
        # too, whose attempts must not settle this one's reservation (gateway.ids.exchange_tag).
        exchange = exchange_key(request_id)
        estimate = prompt_tokens + max_output_tokens
        now = dt.datetime.now(dt.UTC)
        plan = self._plan(quotas, now)
        if counting:
            limits = _counting_limits(plan)
        elif plan.estimate == estimate:
            limits = plan.limits
        else:
            # (Limit(...) directly: dataclasses.replace costs several times as much.)
            limits = [Limit(limit.key, limit.limit, estimate) if tpm else limit for limit, tpm in plan.rates]
            plan.estimate, plan.limits = estimate, limits
        tpm_keys: tuple[str, ...] = ()
        budgets: list[Budget] = []
        if not counting:
            tpm_keys, budgets = plan.tpm_keys, await self._seeded_budgets(plan, now)
        amount = 0
        if budgets:
            # The estimate's price: what pricing Usage(input_tokens=prompt, output_tokens=max output)
            # gives, from the resolved sheet directly (no Usage and Cost objects per request).
            prices = self._catalog().prices_at(backend, model, now, service_tier)
            if long_context is not None:
                prices = long_context.apply(prices, prompt_tokens)
            sheet = sheet_of(prices)
            cost_pico_usd = (
                prompt_tokens * sheet.input
                + max_output_tokens * sheet.output
                + web_searches * sheet.web_search
            )
            # At least one pico-dollar, so a budget that is fully spent refuses even unpriced models.
            amount = max(1, cost_pico_usd)
        if not limits and not budgets:
            return {}
        asked: list[str] = []
        if self.leasing:
            drawn = self._take_local(limits, budgets, amount)
            waits = 0
            while drawn is None and self._asking and waits < LEASE_WAITS:
                # A lease (pool) for one of these keys is being asked for: wait for its answer (one
                # round trip, as long as asking ourselves) and admit from it, instead of every
                # concurrent request going to the shared state on its own meanwhile. Again if the
                # answer was too small (or its bucket ended) and another ask went out meanwhile.
                # Only for limits large enough for full-size leases: a lease capped at 1/LEASE_SHARE
                # of a small limit would not cover the waiters, and near such a limit every unit
                # should stay within reach of the requests asking the shared state.
                answers = {
                    self._asking.get(limit.key)
                    for limit in limits
                    if limit.limit // LEASE_SHARE >= LEASE_REQUESTS * limit.cost
                }
                answers.update(
                    self._asking.get(b.key)
                    for b in budgets
                    if b.limit_pico_usd // LEASE_SHARE >= LEASE_REQUESTS * amount
                )
                answers.discard(None)
                if not answers:
                    break
                for asked_by_other in answers:
                    await asked_by_other.wait()  # type: ignore[union-attr]
                waits += 1
                drawn = self._take_local(limits, budgets, amount)
            if drawn is not None:
                self.local_admissions += 1
                leases, now_s = self._leases, time.monotonic()
                headers = rate_headers(
                    [
                        (limit.key, limit.limit, leases[limit.key].used, leases[limit.key].emptied_at - now_s)
                        for limit in limits
                    ],
                    anthropic,
                )
                if budgets or tpm_keys:
                    self._pending[exchange] = _Pending(
                        None,
                        plan.budget_keys,
                        tpm_keys,
                        estimate,
                        releases=drawn,
                        # Drawn from leases of this second, so of one bucket. Were they not, the
                        # oldest: a correction there can only leave the window before the estimate.
                        tpm_bucket=min((self._leases[key].bucket for key in tpm_keys), default=None),
                    )
                return headers
            # At most one lease (pool) per key held or asked for at a time: concurrent requests that
            # miss it go to the shared state without asking for more, which bounds what a replica
            # can hold unused to one lease per key.
            now_s = time.monotonic()
            asked = [limit.key for limit in limits if self._wants(limit.key, limit.cost, now_s)]
            asked += [b.key for b in budgets if self._wants(b.key, amount, now_s)]
            answer = asyncio.Event()
            for key in asked:
                self._asking[key] = answer
            limits = [
                replace(limit, lease=self._lease_size(limit.key, limit.limit, limit.cost))
                if limit.key in asked
                else limit
                for limit in limits
            ]
            budgets = [
                replace(b, pool_pico_usd=self._lease_size(b.key, b.limit_pico_usd, amount))
                if b.key in asked
                else b
                for b in budgets
            ]
        sent = time.monotonic()
        # One atomic step in the shared state (one Redis round trip): every limit and every budget,
        # all or nothing, so a request refused by its budget uses up no rate limit either.
        if self._admit_now is not None and not self.leasing:
            decision = self._admit_now(limits, budgets, amount, RESERVATION_TTL_S)
        else:
            try:
                decision = await self.state.admit(limits, budgets, amount, ttl_s=RESERVATION_TTL_S)
            finally:
                for key in asked:
                    del self._asking[key]
                if asked:
                    answer.set()
        if decision.unseeded:
            budgets = await self._seed_again(plan, budgets, decision.unseeded, now)
            decision = await self.state.admit(limits, budgets, amount, ttl_s=RESERVATION_TTL_S)
        if not decision.allowed:
            refused = refusal(decision, limits, budgets, amount, web_searches)
            refused.headers.update(rate_headers(_refused_windows(decision, limits), anthropic))
            raise refused
        reservation_id = decision.reservation_id
        releases: list[tuple[str, int]] = []
        if self.leasing and (decision.leases or decision.pools):
            self._keep_leases(limits, budgets, decision, sent)
            releases = [(reservation_id or "", amount) for _ in budgets]  # the pool stays reserved
        if self._leases:
            for limit, (used, reset_s) in zip(limits, decision.windows, strict=False):
                held = self._leases.get(limit.key)
                if held is not None:  # this admission's lease, or one held still: the state's latest
                    held.used, held.emptied_at = used, sent + reset_s
        if budgets or tpm_keys:
            self._pending[exchange] = _Pending(
                reservation_id,
                plan.budget_keys,
                tpm_keys,
                estimate,
                releases=releases,
                tpm_bucket=decision.buckets[plan.tpm_index] if tpm_keys and decision.buckets else None,
            )
        return rate_headers(
            [
                (limit.key, limit.limit, used, reset_s)
                for limit, (used, reset_s) in zip(limits, decision.windows, strict=False)
            ],
            anthropic,
        )

    async def _seeded_budgets(self, plan: _Plan, now: dt.datetime) -> list[Budget]:
        """The plan's budgets to admit against, seeded from the ledger first where not yet."""
        if not plan.seeded:
            for budget, scope, owner in plan.budgets:
                if budget.key not in self._seeded:
                    await self._seed(budget.key, scope, owner, now)
            # A seed that failed (DB down) is tried again on a later request.
            plan.seeded = all(budget.key in self._seeded for budget in plan.budget_list)
        if plan.seeded:
            return plan.budget_list  # never modified: the leasing path builds new lists
        # Meanwhile those budgets are admitted against what the shared state holds of them.
        return [b if b.key in self._seeded else replace(b, seeded=False) for b in plan.budget_list]

    def _wants(self, key: str, cost: int, now: float) -> bool:
        if key in self._asking:
            return False
        lease, pool = self._leases.get(key), self._pools.get(key)
        held = lease.units if lease is not None else pool.left if pool is not None else None
        if held is None:
            return True
        expires = lease.expires if lease is not None else pool.expires  # type: ignore[union-attr]
        if expires <= now:
            return True
        if held < cost:
            # Used up before its time: this key's traffic needs bigger leases (up to the cap).
            self._scale[key] = min(MAX_LEASE_REQUESTS, self._scale.get(key, LEASE_REQUESTS) * 2)
            return True
        return False

    def _lease_size(self, key: str, limit: int, cost: int) -> int:
        size = min(self._scale.get(key, LEASE_REQUESTS) * cost, limit // LEASE_SHARE)
        return size if size >= cost else 0

    def _shrink(self, key: str, unused: int, granted: int) -> None:
        """A lease (pool) ended with more than half of it unused: ask for half as much next time."""
        if unused * 2 > granted:
            scale = self._scale.get(key, LEASE_REQUESTS) // 2
            if scale <= LEASE_REQUESTS:
                self._scale.pop(key, None)
            else:
                self._scale[key] = scale

    def _take_local(
        self, limits: list[Limit], budgets: list[Budget], amount: int
    ) -> list[tuple[str, int]] | None:
        """Admit from this replica's leases and pools if they cover every limit and budget (all or
        nothing, as in the shared state); the (reservation, amount) drawn per budget, or None."""
        now = time.monotonic()
        for limit in limits:
            lease = self._leases.get(limit.key)
            if lease is None or lease.expires <= now or lease.units < limit.cost:
                return None
        for budget in budgets:
            pool = self._pools.get(budget.key)
            if pool is None or pool.expires <= now or pool.left < amount:
                return None
        for limit in limits:
            self._leases[limit.key].units -= limit.cost
        drawn = []
        for budget in budgets:
            pool = self._pools[budget.key]
            pool.left -= amount
            drawn.append((pool.reservation_id, amount))
        return drawn

    def _keep_leases(
        self, limits: list[Limit], budgets: list[Budget], decision: Decision, sent: float
    ) -> None:
        for limit, lease in zip(limits, decision.leases, strict=True):
            if not lease.units:
                continue
            # The state counted them at or after `sent`, so by this clock the bucket ends no earlier
            # than sent + ms_left.
            expires = sent + lease.ms_left / 1000 - LEASE_MARGIN_S
            held = self._leases.get(limit.key)
            if held is not None and held.bucket == lease.bucket:
                held.units += lease.units
                held.granted += lease.units
                continue
            if held is not None:
                self._shrink(limit.key, held.units, held.granted)
                self._hand_back_lease(limit.key, held)
            self._leases[limit.key] = _Lease(
                lease.units, lease.bucket, limit.window_s, expires, granted=lease.units
            )
        for budget, pool in zip(budgets, decision.pools, strict=True):
            if not pool:
                continue
            old = self._pools.get(budget.key)
            if old is not None:
                self._shrink(budget.key, old.left, old.granted)
                self._release_pool(budget.key, old)
            self._pools[budget.key] = _Pool(
                decision.reservation_id or "", pool, sent + POOL_TTL_S, granted=pool
            )
        self._schedule_sweep()

    def _hand_back_lease(self, key: str, lease: _Lease) -> None:
        if lease.units > 0:
            self._queue_settlement(Settlement([Adjustment(key, -lease.units, lease.window_s, lease.bucket)]))
            lease.units = 0

    def _release_pool(self, key: str, pool: _Pool) -> None:
        # Only what no request drew; the drawn money is released by each request's settlement.
        if pool.left > 0:
            self._queue_settlement(Settlement((), [key], releases=[(pool.reservation_id, pool.left)]))
            pool.left = 0

    def _schedule_sweep(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(0.05, self._sweep)

    def _sweep(self) -> None:
        """Hand back what expired leases and pools left unused (every 50 ms while any is held)."""
        self._sweeper = None
        now = time.monotonic()
        for key, lease in list(self._leases.items()):
            if lease.expires <= now:
                self._shrink(key, lease.units, lease.granted)
                self._hand_back_lease(key, lease)
                del self._leases[key]
        for key, pool in list(self._pools.items()):
            if pool.expires <= now:
                self._shrink(key, pool.left, pool.granted)
                self._release_pool(key, pool)
                del self._pools[key]
        if self._leases or self._pools:
            self._schedule_sweep()

    def release_leases(self) -> None:
        """Hand back every lease and pool now (shutdown); `drain` then waits for it."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for key, lease in self._leases.items():
            self._hand_back_lease(key, lease)
        for key, pool in self._pools.items():
            self._release_pool(key, pool)
        self._leases.clear()
        self._pools.clear()

    async def _seed(self, key: str, scope: str, owner: str, now: dt.datetime) -> None:
        if key in self._seeded or self._spend is None:
            return
        # One ledger query per budget and month, however many requests arrive while it runs.
        async with self._seed_locks.setdefault(key, asyncio.Lock()):
            if key in self._seeded:
                return
            for _ in range(SEED_TRIES):
                # What the state holds beyond the ledger's spend: attempts settled since it lost the
                # budget (or before its first seed). Those whose events reached the ledger already are
                # in its spend too, and count once (`budget_seed`).
                unseeded = await self.state.budget_unseeded(key)
                # The ledger's events whose settlement may still be on its way (created in the last
                # LATE_SETTLE_S): event ids begin with their creation time (gateway/ids.py).
                recent_from = f"{int((time.time() - LATE_SETTLE_S) * 1000):012x}"
                month_start = now.date().replace(day=1)
                try:
                    spent, in_ledger = await self._spend(scope, owner, month_start, unseeded, recent_from)
                except Exception:
                    # DB down: admit against what the shared state knows; seed on a later request.
                    log.warning("could not read this month's spend for %s %s", scope, owner, exc_info=True)
                    return
                if await self.state.budget_seed(key, spent, unseeded, list(in_ledger)):
                    self._seeded.add(key)
                    self._seed_locks.pop(key, None)  # gone already if the month turned meanwhile
                    return
            # Attempts settled on it while each try read the ledger: as with the DB down, admitted
            # against what the state holds, and seeded on a later request.
            log.warning("could not seed budget %s: attempts kept settling on it", key)

    async def _seed_again(
        self, plan: _Plan, budgets: list[Budget], lost: Sequence[str], now: dt.datetime
    ) -> list[Budget]:
        """The shared state lost what it held of `lost` budgets (Redis restarted without its data,
        failed over to a replica behind it, or evicted the keys): seed them again from the ledger,
        once however many requests found them lost. The budgets to ask with once more: those not
        checked for their seed again (one that failed, DB down, is admitted against what the state
        holds, as before a first seed)."""
        for key in lost:
            if key in self._seeded:
                log.warning("the shared state lost budget %s: seeding it again from the ledger", key)
                self._seeded.discard(key)
        plan.seeded = False
        for budget, scope, owner in plan.budgets:
            if budget.key in lost:
                await self._seed(budget.key, scope, owner, now)
        plan.seeded = all(budget.key in self._seeded for budget in plan.budget_list)
        return [replace(b, seeded=False) if b.key in lost else b for b in budgets]

    def settle(self, event: UsageEvent) -> None:
        """Called for every usage event; the shared-state work happens off the request path, every
        settlement of one event-loop turn in one round trip."""
        exchange = exchange_key(event.request_id)  # recorded in the exchange's own context
        pending = self._pending.get(exchange)
        if pending is None:
            return
        releases: Sequence[tuple[str, int]]
        counted_in: int | None = None  # the estimate's bucket, where this settlement corrects it
        if isinstance(pending, tuple):  # settled before (_Settled): a later attempt
            _, budget_keys, tpm_keys = pending
            estimate, reservation, releases = 0, "", [("", 0)] * len(budget_keys)
        elif not event.ok and not pending.finished:
            # A failed attempt: a retry, fallback or hedge of the same request may still be on its
            # way, reserved by nothing if this released the request's reservation, and concurrent
            # requests would be admitted into the money it is about to spend. So its tokens and
            # cost count now, and the reservation (and token estimate) stays until an attempt
            # answers or the exchange ends without one (`finish`).
            budget_keys, tpm_keys = pending.budget_keys, pending.tpm_keys
            estimate, reservation, releases = 0, "", [("", 0)] * len(budget_keys)
            pending.held_after_failure = True
        else:
            budget_keys, tpm_keys = pending.budget_keys, pending.tpm_keys
            self._pending[exchange] = (pending.created, budget_keys, tpm_keys)
            estimate, reservation, releases = (
                pending.estimated_tokens,
                pending.reservation_id or "",
                pending.releases,
            )
            counted_in = pending.tpm_bucket
        self._apply(
            budget_keys,
            tpm_keys,
            event.usage.total_tokens - estimate,
            reservation,
            event.cost_pico_usd,
            releases,
            counted_in,
            event.event_id,
        )

    def _apply(
        self,
        budget_keys: tuple[str, ...],
        tpm_keys: tuple[str, ...],
        delta: int,
        reservation: str,
        cost_pico_usd: int,
        releases: Sequence[tuple[str, int]],
        counted_in: int | None = None,
        event_id: str = "",
    ) -> None:
        """Settle in the shared state: `delta` tokens on each token limit, `cost_pico_usd` spent on
        each budget, `reservation` (or `releases`) released.

        Tokens fewer than the estimate are given back in the bucket the estimate was counted in
        (`counted_in`), and not at all once that bucket has left the window: the estimate no longer
        counts then, and taken from the current bucket they would free room the window never held
        (a request that ran longer than the window let the next minute admit the limit plus its
        unused estimate). Tokens beyond the estimate (or an attempt's after the first) count in the
        current bucket: they were used by the time they are known, and that bucket holds them a full
        window from then, where the estimate's would let them go sooner, or drop them had it left."""
        bucket = correction_bucket(delta, counted_in)
        if self._settle_attempt is not None:
            # In process: settled at once, as a batch of one would be, without a task, a loop turn
            # and the batching that a round trip to Redis is worth (nor a Settlement built).
            # Budgets' use is read from the state when /metrics asks (budget_usage_ratio), not
            # reported back after every attempt.
            if (delta and tpm_keys) or budget_keys:
                self._settle_attempt(
                    tpm_keys,
                    delta,
                    budget_keys,
                    reservation,
                    cost_pico_usd,
                    releases,
                    report=False,
                    bucket=bucket,
                    event_id=event_id,
                )
            return
        if delta:
            # Token-limit corrections are summed per key and bucket until the flush (one Adjustment
            # per key and bucket per flush, not one per key per attempt): the state adds them up.
            deltas = self._tpm_deltas
            for key in tpm_keys:
                where = (key, bucket)
                deltas[where] = deltas.get(where, 0) + delta
        if budget_keys:
            self._settlements.append(
                Settlement(
                    (),
                    budget_keys,
                    reservation,
                    cost_pico_usd,
                    releases=releases,
                    event_id=event_id,
                )
            )
        self._start_flush()

    def _queue_settlement(self, settlement: Settlement) -> None:
        self._settlements.append(settlement)
        self._start_flush()

    def settling(self) -> bool:
        """Settlements are queued or on their way to the shared state."""
        return self._flusher is not None and not self._flusher.done()

    def _start_flush(self) -> None:
        if self._flusher is None or self._flusher.done():
            # It settles every request's batch, not only the one that started it.
            self._flusher = detached(self._flush())

    async def _flush(self) -> None:
        while self._settlements or self._tpm_deltas:
            # Let this turn's other settlements join the batch. Not longer: until its settlement
            # lands, a finished request counts with its estimate, and one that cost more than that
            # would let the next admissions see less spent than there is.
            await asyncio.sleep(0)
            batch, self._settlements = self._settlements, []
            deltas, self._tpm_deltas = self._tpm_deltas, {}
            if deltas:
                batch.append(
                    Settlement(
                        [Adjustment(key, delta, bucket=bucket) for (key, bucket), delta in deltas.items()]
                    )
                )
            if not batch:
                continue
            try:
                # The settlement reports each budget's use as it leaves it: no second round trip.
                self._note_budget_usage(await self.state.settle_many(batch))
            except Exception:
                log.warning("could not settle %d attempts in the shared state", len(batch), exc_info=True)

    @property
    def budget_usage_ratio(self) -> dict[str, float]:
        """Per tenant id, the share of its monthly budget used (spent plus reserved): in process read
        from the state now, with Redis as of the last settlement (which reports it for free)."""
        usage_now = self._budget_usage_now
        if usage_now is None or self._settle_attempt is None:
            return self._budget_usage_ratio
        ratios: dict[str, float] = {}
        # Oldest month first, so a tenant's current month wins over the one before.
        for key, (tenant, limit) in self._tenant_budgets.items():
            usage = usage_now(key)
            if usage is not None:
                ratios[tenant] = (usage[0] + usage[1]) / max(limit, 1)
        return ratios

    def _note_budget_usage(self, usage: dict[str, tuple[int, int]]) -> None:
        for key, (spent, reserved) in usage.items():
            tenant = self._tenant_budgets.get(key)
            if tenant is not None:
                self._budget_usage_ratio[tenant[0]] = (spent + reserved) / max(tenant[1], 1)

    def finish(self, request_id: str) -> None:
        """The request's HTTP exchange is over (every attempt made): forget it after a grace period."""
        exchange = exchange_key(request_id)
        pending = self._pending.get(exchange)
        if isinstance(pending, _Pending) and not pending.held_after_failure:
            pending.finished = True
        elif isinstance(pending, _Pending):
            # Its attempts failed (or the client left) and none answered: nothing can follow now, so
            # what the request reserved and its token estimate are given back (the attempts' tokens
            # and costs were counted as they settled). One none of whose attempts settled yet is
            # marked finished above: its first settlement, failed or not, releases as before.
            budget_keys, tpm_keys = pending.budget_keys, pending.tpm_keys
            self._pending[exchange] = (pending.created, budget_keys, tpm_keys)
            self._apply(
                budget_keys,
                tpm_keys,
                -pending.estimated_tokens,
                pending.reservation_id or "",
                0,
                pending.releases,
                pending.tpm_bucket,
            )
        if pending is not None:
            self._finished_at.append(time.monotonic())
            self._finished.append(exchange)

    def _expire(self) -> None:
        # At most every EXPIRE_EVERY_S, not on every admission: forgetting a request up to that much
        # later changes nothing it could still settle.
        now = time.monotonic()
        if now < self._next_expiry:
            return
        self._next_expiry = now + EXPIRE_EVERY_S
        finished_at, finished = self._finished_at, self._finished
        while finished_at and finished_at[0] <= now - FINISHED_GRACE_S:
            finished_at.popleft()
            self._pending.pop(finished.popleft(), None)
        horizon = now - PENDING_TTL_S
        while self._pending:
            request_id, pending = next(iter(self._pending.items()))
            created = pending[0] if isinstance(pending, tuple) else pending.created
            if created > horizon:
                break
            del self._pending[request_id]

    async def drain(self) -> None:
        """Wait for background settlements (shutdown, tests)."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.gather(self._flusher, return_exceptions=True)
