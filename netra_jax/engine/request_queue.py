"""The scheduler's waiting queue under each scheduling policy (vLLM's `--scheduling-policy`): first-come-first-served,
or by (priority, arrival) where a smaller priority value is served first; each also names its preemption victim."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

from netra_jax.engine.request import Request
from netra_jax.options import SCHEDULING_POLICIES


def check_priority(priority: object, policy: str) -> int:
    """A request's priority as an int; refused unless 0 when the policy is not "priority" (as vLLM refuses it)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(
            f"got priority {priority} but priority scheduling is not enabled (the engine schedules {policy}; "
            "start it with --scheduling-policy priority)"
        )
    return priority


class FCFSQueue:
    """Waiting requests in arrival order; a preempted or deferred request goes back to the front. The victim of a
    preemption is the most recently admitted running request."""

    policy = "fcfs"

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def prepend(self, reqs: Sequence[Request]) -> None:
        """Put `reqs` (in their order) back at the head of the queue."""
        self._q.extendleft(reversed(reqs))

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def victim(self, running: list[Request]) -> Request:
        """The running request to preempt when blocks run out (`running` in admission order, not empty)."""
        return running[-1]

    def victims_for(self, req: Request, running: list[Request]) -> list[Request]:
        """Running requests waiting `req` may preempt to be admitted, first victim first: none under fcfs."""
        return []

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Waiting requests ordered by (priority, arrival time, creation order): a preempted request goes back to its
    place in that order, not to the front. The victim of a preemption is the running request that is last in that
    order (largest priority value, latest arrival), as in vLLM's v1 scheduler."""

    policy = "priority"

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], Request]] = []

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.sort_key, req))

    def prepend(self, reqs: Iterable[Request]) -> None:
        for req in reqs:
            self.add(req)

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[1] is not req]
        heapq.heapify(self._heap)

    def victim(self, running: list[Request]) -> Request:
        return max(running, key=lambda r: r.sort_key)

    def victims_for(self, req: Request, running: list[Request]) -> list[Request]:
        """The running requests of strictly larger priority value than `req`, lowest priority first. Equal values
        never preempt each other: arrival orders them in the queue, not by preemption (else two requests could take
        turns evicting each other, each resumed one preempting the other again)."""
        return sorted((r for r in running if r.priority > req.priority), key=lambda r: r.sort_key, reverse=True)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (r for _, r in sorted(self._heap))


WaitingQueue = FCFSQueue | PriorityQueue


def make_waiting_queue(policy: str) -> WaitingQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; supported: {', '.join(SCHEDULING_POLICIES)}")
