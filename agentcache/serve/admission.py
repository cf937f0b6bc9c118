"""Admission, shared fairly between tenants.

A request holds a place from when it is admitted to when its reply ends. At most `limit` places
are held at once; beyond that a request gets a 429 with `Retry-After` (the recent request time)
rather than waiting without bound. Of the admitted, at most `running` (the engine's batch) run on
the runtime at once; the others wait in one queue per tenant, and a freed turn goes to the tenants
round robin. So a tenant's burst waits behind itself, never in front of another tenant's request.
While several tenants are active (each asked for a place within the last minute), one tenant runs
at most all turns but one: a request of another tenant then starts at once rather than after one
of the busy tenant's requests ends. A tenant alone has every turn.

When every place is held, a request of a tenant that holds fewer places than the busiest tenant
takes that tenant's newest waiting place, whose request gets the 429 instead (longest queue drop):
one tenant's burst cannot shut another out with 429s either. Equal shares; there are no weights.

Why our own: the asyncio queues and semaphores of the standard library and the rate limiters on
PyPI are first come first served or count requests per time; none hands turns round robin between
tenants and sheds from the longest queue. It is small, and runs on the event loop's thread (no lock).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque

from agentcache.serve.api import ApiError

__all__ = ["Admission", "Slot", "ACTIVE_S"]

ACTIVE_S = 60.0  # a tenant that asked for a place this recently counts as active


class Admission:
    """The places of one route (on the event loop's thread only: no lock)."""

    def __init__(self, limit: int, running: int | None = None) -> None:
        self.limit = limit
        self.running_limit = running or limit
        self._seen: dict[str | None, float] = {}  # tenant -> when it last asked for a place
        self.in_flight = 0  # places held: waiting or running
        self.running = 0
        self._held: Counter[str | None] = Counter()  # places per tenant
        self._running_by: Counter[str | None] = Counter()  # turns per tenant
        self._waiting: dict[str | None, deque[Slot]] = {}  # per tenant, oldest first
        self._order: deque[str | None] = deque()  # tenants with a waiting request, whose turn is next first
        self._seconds = 1.0  # moving average of a request's time

    @property
    def waiting(self) -> int:
        return self.in_flight - self.running

    @property
    def spare(self) -> int:
        """Turns no tenant may fill alone: one while several tenants are active (asked for a place
        within `ACTIVE_S`), so another's request starts at once; none with one tenant, which then
        has every turn."""
        now = time.monotonic()
        for tenant in [t for t, seen in self._seen.items() if now - seen > ACTIVE_S]:
            del self._seen[tenant]
        return 1 if len(self._seen) > 1 and self.running_limit > 1 else 0

    def enter(self, tenant: str | None = None) -> "Slot":
        """A place for a request of `tenant`, or a 429."""
        self._seen.pop(tenant, None)
        self._seen[tenant] = time.monotonic()
        if self.in_flight >= self.limit:
            busiest = self._busiest_waiting()
            if busiest is None or self._held[busiest] <= self._held[tenant] + 1:
                raise self._full()
            self._waiting[busiest][-1]._refuse(self._full())  # longest queue drop: its newest waits no more
        self.in_flight += 1
        self._held[tenant] += 1
        return Slot(self, tenant, time.perf_counter())

    async def turn(self, slot: "Slot") -> None:
        """Wait until `slot` may run (at once when a turn is free for its tenant and nobody waits);
        a 429 when its place is taken by another tenant's request meanwhile."""
        if self._may_run(slot.tenant) and not self._order:
            self._run(slot)
            return
        slot._turn = asyncio.get_running_loop().create_future()
        queue = self._waiting.setdefault(slot.tenant, deque())
        if not queue:
            self._order.append(slot.tenant)
        queue.append(slot)
        self._next()
        try:
            await slot._turn
        finally:
            if not slot.running:  # refused, or cancelled while waiting
                self._unqueue(slot)

    def _may_run(self, tenant: str | None) -> bool:
        if self.running >= self.running_limit:
            return False
        return self._running_by[tenant] < self.running_limit - self.spare

    def _run(self, slot: "Slot") -> None:
        slot.running = True
        self.running += 1
        self._running_by[slot.tenant] += 1

    def _next(self) -> None:
        """Hand free turns to the waiting, one tenant after another (skipping a tenant at its share)."""
        handed = True
        while handed and self.running < self.running_limit:
            handed = False
            for _ in range(len(self._order)):
                tenant = self._order.popleft()
                if not self._may_run(tenant):
                    self._order.append(tenant)
                    continue
                queue = self._waiting[tenant]
                slot = queue.popleft()
                if queue:
                    self._order.append(tenant)  # its next request waits for the others' turns
                else:
                    del self._waiting[tenant]
                if slot._turn.done():  # cancelled while waiting: its task has yet to release it
                    handed = True
                    break
                self._run(slot)
                slot._turn.set_result(None)
                handed = True
                break

    def _unqueue(self, slot: "Slot") -> None:
        queue = self._waiting.get(slot.tenant)
        if queue is None or slot not in queue:
            return
        queue.remove(slot)
        if not queue:
            del self._waiting[slot.tenant]
            self._order.remove(slot.tenant)

    def _busiest_waiting(self) -> str | None:
        """The tenant holding the most places among those with a waiting request."""
        return max(self._waiting, key=lambda tenant: self._held[tenant], default=None)

    def _full(self) -> ApiError:
        wait = max(1, math.ceil(self._seconds))
        return ApiError(429, f"the server is serving its limit of {self.limit} requests; retry after {wait} s",
                        code="queue_full", headers={"Retry-After": str(wait)})

    def _leave(self, slot: "Slot") -> None:
        self.in_flight -= 1
        self._held[slot.tenant] -= 1
        if not self._held[slot.tenant]:
            del self._held[slot.tenant]
        if slot.running:
            slot.running = False
            self.running -= 1
            self._running_by[slot.tenant] -= 1
            if not self._running_by[slot.tenant]:
                del self._running_by[slot.tenant]
            self._seconds = 0.8 * self._seconds + 0.2 * (time.perf_counter() - slot.entered)
        self._unqueue(slot)
        self._next()


class Slot:
    """One admitted request's place; `release` is idempotent (a stream releases it when it ends, and
    its response's background task again, for a stream that never started)."""

    def __init__(self, admission: Admission, tenant: str | None, entered: float) -> None:
        self._admission, self.tenant, self.entered = admission, tenant, entered
        self.running = False
        self._turn: asyncio.Future | None = None  # set while it waits for a turn
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._leave(self)

    def _refuse(self, error: ApiError) -> None:
        """Give up the place while waiting: `turn` raises `error` (the caller releases, a no-op then)."""
        self._admission._unqueue(self)
        self.release()
        if self._turn is not None and not self._turn.done():
            self._turn.set_exception(error)
