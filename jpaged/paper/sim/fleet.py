"""A fleet of simulated replicas behind a router, on one virtual clock (issue 33, item 5).

Each replica is a real LLMEngine (scheduler, block manager and prefix cache run for real) whose
SimExecutor keeps its own virtual clock. One event loop advances them together in time order,
taking at every turn the earliest of:
(a) a replica's step ending: the requests it finished leave the router's loads, and each one's
    session sends its next turn after the user's think time, its prompt the finished prompt plus
    the reply the replica produced plus the new query;
(b) a request arriving: the router picks a replica from its prompt and the loads at that moment;
(c) the busy replica with the earliest clock running its next step.
Ties go in that order: a request finishing at t is gone for one arriving at t, and a request
arriving at t joins the step that starts at t. A step may end past the next arrival; that request
then waits for the step, as on a real server, and the router learns of the step's finishes only
at its end. An idle replica's clock jumps to the arrival it is sent (`advance_to`).

A measurement window [measure_from, measure_until) keeps warm-up out of the numbers: only requests
arriving in it are recorded, the prefix-hit rate counts admissions from its start on, and the run
stops once every request that arrived before its end has finished (later turns still load the
replicas until then, as they would in a service that keeps running).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import logging
import time
from collections.abc import Sequence

import numpy as np
from tqdm.auto import tqdm

from jpaged.core.outputs import RequestOutput
from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.paper.metrics import RequestRecord
from jpaged.paper.sim.routing import Router
from jpaged.paper.workloads import Session

logger = logging.getLogger(__name__)

_INF = float("inf")


@dataclasses.dataclass
class FleetResult:
    """What one run of a fleet measured (requests arriving in the measurement window)."""

    records: list[RequestRecord]  # finished requests, in finishing order; request_id = routing order
    num_rejected: int  # requests the chosen replica refused at its door or could never fit (their sessions end)
    replicas: list[dict]  # per replica: requests routed, steps, busy fraction, preemptions, prefix-cache stats
    decisions: dict[str, int]  # the router's picks (the whole run) by the rule that made them
    num_followups: int  # requests routed (the whole run) that were a session's second turn or later
    prefix_hit_rate: float  # prompt tokens served from the replicas' prefix caches / prompt tokens admitted
    end_time_s: float  # the latest replica clock when the run stopped (virtual seconds)
    wall_s: float  # wall-clock seconds the run took


@dataclasses.dataclass
class _Pending:
    index: int  # routing order (the record's request_id)
    session: int  # index into the sessions list
    turn: int
    prompt: np.ndarray  # i32 token ids
    arrival: float
    replica: int


def run_fleet(engines: Sequence[LLMEngine], router: Router, sessions: Sequence[Session], *,
              measure_from: float = 0.0, measure_until: float = _INF, show_progress: bool = False) -> FleetResult:
    """Serves the turns of `sessions` on `engines` (fresh simulated replicas) through `router`,
    measuring the requests that arrive in [measure_from, measure_until) (see the module docstring).

    Each turn generates exactly its output length (EOS ignored). Returns the measured requests'
    timings on the common virtual clock and each replica's counters (see `FleetResult`).
    """
    if not engines:
        raise ValueError("engines: a fleet needs at least one replica")
    if not 0.0 <= measure_from < measure_until:
        raise ValueError(f"need 0 <= measure_from < measure_until, got {measure_from}, {measure_until}")
    for r, engine in enumerate(engines):
        if not callable(getattr(engine.executor, "advance_to", None)):
            raise TypeError(f"engines[{r}]: the fleet runs simulated replicas (an executor with advance_to)")
        if engine.has_unfinished() or engine.executor.now() != 0.0:
            raise ValueError(f"engines[{r}]: must be fresh (no requests, clock at 0)")
    loop = _FleetLoop(list(engines), router, list(sessions), measure_from, measure_until)
    start = time.perf_counter()
    loop.run(show_progress)
    wall = time.perf_counter() - start
    end = max(e.executor.now() for e in engines)
    replicas = [{"requests": loop.routed[r], "steps": e.num_steps,
                 "busy_fraction": e.executor.busy_s / end if end else 0.0,
                 "num_preemptions": e.scheduler.num_preemptions, **e.prefix_cache_stats()}
                for r, e in enumerate(engines)]
    # [2]: (cached, admitted) prompt tokens of the whole fleet since the window opened
    cached, admitted = np.sum(loop.counters(), axis=0) - np.sum(loop.at_start, axis=0)
    return FleetResult(loop.records, loop.num_rejected, replicas, dict(router.decisions), loop.num_followups,
                       float(cached / admitted) if admitted else 0.0, end, wall)


class _FleetLoop:
    """The event loop of `run_fleet` (the module docstring states its order)."""

    def __init__(self, engines: list[LLMEngine], router: Router, sessions: list[Session], start: float, until: float):
        self.engines, self.router, self.sessions = engines, router, sessions
        self.start, self.until = start, until
        self.at_start: list[tuple[int, int]] | None = None  # prefix-cache counters when the window opened
        self.loads = [0] * len(engines)  # requests routed to each replica and not finished
        self.routed = [0] * len(engines)
        self.blocked = [False] * len(engines)  # made no progress: waits for a new request
        self.pending: dict[str, _Pending] = {}
        self.num_open = 0  # pending requests that arrived before the window's end
        self.records: list[RequestRecord] = []
        self.num_rejected = 0
        self.num_routed = 0
        self.num_followups = 0
        self._order = 0  # tie-breaker of the heaps: first pushed, first served
        # (time, order, session index, turn, prompt token ids i32[P])
        self.arrivals: list[tuple[float, int, int, int, np.ndarray]] = []
        # (a step's end, order, replica, the requests it finished)
        self.finishes: list[tuple[float, int, int, list[RequestOutput]]] = []
        for i, session in enumerate(sessions):
            self._push_arrival(session.start_time, i, 0, session.queries[0])

    def counters(self) -> list[tuple[int, int]]:
        """Each replica's (prompt tokens served from its prefix cache, prompt tokens admitted)."""
        return [(e.scheduler.admission.num_cached_tokens, e.scheduler.admission.num_prompt_tokens) for e in self.engines]

    def _push_arrival(self, t: float, session: int, turn: int, prompt: np.ndarray) -> None:
        self._order += 1
        heapq.heappush(self.arrivals, (t, self._order, session, turn, prompt))

    def run(self, show_progress: bool) -> None:
        """Processes events until every request arriving before the window's end has finished."""
        bar = tqdm(total=sum(len(s.queries) for s in self.sessions), desc="fleet", mininterval=1.0,
                   disable=not show_progress)
        while self.num_open or (self.arrivals and self.arrivals[0][0] < self.until):
            t_finish = self.finishes[0][0] if self.finishes else _INF
            t_arrival = self.arrivals[0][0] if self.arrivals else _INF
            replica, t_step = None, _INF
            for r, engine in enumerate(self.engines):
                if not self.blocked[r] and engine.has_unfinished() and engine.executor.now() < t_step:
                    replica, t_step = r, engine.executor.now()
            t = min(t_finish, t_arrival, t_step)
            if t == _INF:
                stuck = [r for r, e in enumerate(self.engines) if e.has_unfinished()]
                raise RuntimeError(f"replicas {stuck} made no progress with requests unfinished and none left to arrive")
            if self.at_start is None and t >= self.start:
                self.at_start = self.counters()
            if t_finish == t:
                bar.update(self._finish(heapq.heappop(self.finishes)[3]))
            elif t_arrival == t:
                bar.update(self._route_next())
            else:
                self._step(replica)
            if show_progress and self._order % 256 == 0:
                bar.set_postfix(t_s=f"{t:.0f}", loads=self.loads, refresh=False)
        bar.close()
        if self.at_start is None:  # the window opened after the last event
            self.at_start = self.counters()

    def _route_next(self) -> int:
        """Routes the earliest arrival and queues it on the chosen replica; returns the turns it
        ends (those of its session when the replica refuses it, else 0)."""
        t, _, session_index, turn, prompt = heapq.heappop(self.arrivals)
        r = self.router.route(prompt.tolist(), self.loads)
        if not 0 <= r < len(self.engines):
            raise RuntimeError(f"the router picked replica {r} of {len(self.engines)}")
        engine = self.engines[r]
        if not engine.has_unfinished():
            engine.executor.advance_to(t)
        session = self.sessions[session_index]
        request_id = f"{session.session_id}.{turn}"
        try:
            engine.add_request(request_id, prompt, _params(session.output_lens[turn]), arrival_time=t)
        except (TypeError, ValueError) as exc:  # the door refused it, as a server answers 400: the session ends
            logger.warning("replica %d refused request %s: %s", r, request_id, exc)
            self.num_rejected += self.start <= t < self.until
            return len(session.queries) - turn
        self.pending[request_id] = _Pending(self.num_routed, session_index, turn, prompt, t, r)
        self.num_open += t < self.until
        self.loads[r] += 1
        self.routed[r] += 1
        self.num_routed += 1
        self.num_followups += turn > 0
        self.blocked[r] = False
        return 0

    def _step(self, r: int) -> None:
        """Runs replica r's next step; its finished requests are delivered when the step ends."""
        engine = self.engines[r]
        steps = engine.num_steps
        finished = [o for o in engine.step() if o.finished]
        if finished:
            self._order += 1
            heapq.heappush(self.finishes, (engine.executor.now(), self._order, r, finished))
        elif engine.num_steps == steps:
            self.blocked[r] = True

    def _finish(self, outputs: list[RequestOutput]) -> int:
        """Records finished requests and sends their sessions' next turns; returns turns accounted."""
        done = 0
        for out in outputs:
            request = self.pending.pop(out.request_id)
            self.loads[request.replica] -= 1
            self.num_open -= request.arrival < self.until
            measured = self.start <= request.arrival < self.until
            session = self.sessions[request.session]
            done += 1
            if out.error is not None:  # never servable: the session ends here
                self.num_rejected += measured
                done += len(session.queries) - request.turn - 1
                continue
            if out.first_scheduled_time < request.arrival:
                raise RuntimeError(f"request {out.request_id} was scheduled before it arrived")
            reply = out.output_token_ids[0]
            if measured:
                self.records.append(RequestRecord(request.index, request.arrival, out.first_scheduled_time,
                                                  out.first_token_time, out.finish_time, len(request.prompt),
                                                  len(reply)))
            turn = request.turn + 1
            if turn < len(session.queries):
                prompt = np.concatenate([request.prompt, np.asarray(reply, np.int32), session.queries[turn]])
                self._push_arrival(out.finish_time + session.think_s[request.turn], request.session, turn, prompt)
        return done


@functools.lru_cache(maxsize=4096)
def _params(max_tokens: int) -> SamplingParams:
    """A turn's sampling parameters: exactly `max_tokens` tokens (frozen, so shared between turns)."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)
