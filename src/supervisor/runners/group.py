"""A model sharded over several runner processes with ``mx.distributed``,
supervised as one unit.

Each rank is an ordinary runner (its own :class:`RunnerHandle`: pipes,
heartbeats, pings, stall watchdog, exit audit). The group stands where a
single handle would for the model's entry:

- **load**: every rank imports mlx, then joins the ring and loads its shard
  with mlx-lm's ``sharded_load``. The ring's last rank connects first and its
  ``accept`` has no timeout, so ranks 0..N-2 get their LoadModel first and
  the last one only when the others listen. Ready when every rank is;
- **requests** go to every rank in the same order (the entry serves one at
  a time); rank 0's frames are the answer, the others' are dropped;
- **death of any rank** tears the whole group down at once, and only then
  is the group's exit reported: the restart policy applies to the group;
  ``exit_info`` names the rank that died first and holds every rank's exit;
- **unload** escalates every rank in parallel.
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import anyio
import msgspec
import psutil
from anyio.abc import TaskGroup

from ipc.messages import (
    Distributed,
    EngineStats,
    ExitInfo,
    LoadFailed,
    LoadModel,
    LoadProgress,
    MemoryFigures,
    MemoryPlan,
    RankExit,
    RankInfo,
    Ready,
    RunnerCommand,
    RunnerEvent,
)
from supervisor.config import ModelConfig, SupervisorConfig
from supervisor.memory.monitor import default_guard_bytes
from supervisor.memory.ranks import room_problem
from supervisor.runners.escalation import Rung
from supervisor.runners.exits import classify_exit
from supervisor.runners.handle import RunnerHandle, RunnerStartError
from supervisor.runners.placement import free_ports, group_places
from supervisor.runners.protocol import Runner
from supervisor.runners.requests import (
    EventQueue,
    EventWaiter,
    RequestStream,
    RunnerGone,
    raise_gone,
)
from supervisor.waiting import first_of

__all__ = ["RunnerGroup"]

_REMOTE_PORTS_IN_USE: set[int] = set()
_NEXT_BLOCK = 0  # the port block the next group with remote ranks tries first
"""Ports the daemon's live groups hold on other machines (base + offset + rank)."""
PEER_EXIT_GRACE_S = 1.0
"""How long a rank has to exit after a peer died and it got Shutdown."""
LISTEN_POLL_S = 0.01
"""How often the ports of the first ranks are looked at while the last waits
(they listen within a few ms of their LoadModel)."""

Spawner = Callable[[RunnerHandle], Awaitable[None]]


def listening(pid: int, port: int) -> bool:
    """Whether process ``pid`` listens on TCP ``port``. Read from the kernel's
    tables: connecting to probe would be taken for the peer by the ring."""
    try:
        connections = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in connections)


class RunnerGroup:
    """The supervisor's view of one model's ranks.

    Args:
        spec: the model (``spec.ranks`` processes).
        config: the daemon config.
    """

    def __init__(self, spec: ModelConfig, config: SupervisorConfig) -> None:
        self.spec = spec
        self.config = config
        self.places = group_places(spec)
        self.size = len(self.places)
        self.ranks = [
            RunnerHandle(spec, config, rank=r, host=place.host)
            for r, place in enumerate(self.places)
        ]
        self.exited = anyio.Event()
        self.exit_info: ExitInfo | None = None
        self.first_dead: int | None = None
        self.stop_requested = False
        self._readies: dict[int, Ready] = {}
        self._load_failed = False
        self._failure: str | None = None  # a bug in the group's own task
        self._hostfile_dir: Path | None = None
        self._remote_ports: list[int] = []
        self.rank_need_bytes: int | None = None  # one rank's estimate, set by the registry
        self._events = EventQueue(self)

    # --- what the model's entry reads, as of a single runner ------------------

    @property
    def lead(self) -> RunnerHandle:
        """Rank 0: it answers requests."""
        return self.ranks[0]

    @property
    def log(self) -> Any:
        return self.lead.log.bind(ranks=self.size)

    @property
    def pid(self) -> int | None:
        return self.lead.pid

    @property
    def alive(self) -> bool:
        return not self.exited.is_set() and all(h.alive for h in self.ranks)

    @property
    def started_at(self) -> float | None:
        return self.lead.started_at

    @property
    def started_monotonic(self) -> float:
        return self.lead.started_monotonic

    @property
    def create_time(self) -> float | None:
        return self.lead.create_time

    @property
    def memory(self) -> MemoryFigures:
        """Every rank's MLX memory added up (the peak: the highest rank's)."""
        figures = [h.memory for h in self.ranks]
        return MemoryFigures(
            active_bytes=sum(f.active_bytes for f in figures),
            cache_bytes=sum(f.cache_bytes for f in figures),
            peak_bytes=max(f.peak_bytes for f in figures),
        )

    @property
    def engine_stats(self) -> EngineStats | None:
        return self.lead.engine_stats

    @property
    def kill_cause(self) -> str | None:
        return next((h.kill_cause for h in self.ranks if h.kill_cause), None)

    @property
    def footprint_bytes(self) -> int:
        return sum(h.footprint_bytes for h in self.ranks)

    @property
    def rss_bytes(self) -> int | None:
        sizes = [h.rss_bytes for h in self.ranks if h.rss_bytes is not None]
        return sum(sizes) if sizes else None

    def measure_rss(self) -> int | None:
        for handle in self.ranks:
            handle.measure_rss()
        return self.rss_bytes

    def rank_info(self) -> list[RankInfo]:
        """One line per rank for ``status``."""
        lines = []
        for rank, handle in enumerate(self.ranks):
            alive = handle.alive
            state = (
                "exited"
                if handle.exited.is_set()
                else {"idle": "ready"}.get(handle.watchdog.phase, handle.watchdog.phase)
            )
            lines.append(
                RankInfo(
                    rank=rank,
                    pid=(handle.pid if handle.host is None else handle.runner_pid)
                    if alive
                    else None,
                    host=handle.host or self.places[rank].ip,
                    state=state,
                    rss_bytes=handle.measure_rss() if alive else None,
                    mlx_active_bytes=handle.memory.active_bytes if alive else None,
                    mlx_peak_bytes=handle.memory.peak_bytes if alive else None,
                )
            )
        return lines

    # --- start ---------------------------------------------------------------

    async def start(self, spawn: Spawner, task_group: TaskGroup) -> None:
        """Spawn every rank (at once), then watch them as one.

        Raises:
            RunnerStartError: a rank could not start; the others are reaped.
        """
        failures: list[str] = []

        async def spawn_rank(rank: int, handle: RunnerHandle) -> None:
            try:
                await spawn(handle)
            except RunnerStartError as exc:
                failures.append(f"rank {rank}: {exc}")

        async with anyio.create_task_group() as tg:
            for rank, handle in enumerate(self.ranks):
                tg.start_soon(spawn_rank, rank, handle)
        if failures:
            with anyio.CancelScope(shield=True):
                await self._escalate(self.ranks, "a rank failed to start", first="sigkill")
            self._events.close()
            raise RunnerStartError("; ".join(sorted(failures)))
        task_group.start_soon(self._run, name=f"group {self.spec.name}")

    # --- talking -------------------------------------------------------------

    async def send(self, command: RunnerCommand) -> None:
        """Send ``command`` to every rank, rank 0 first (a LoadModel: each
        rank its own, in the order the ring forms).

        Raises:
            RunnerGone: the group is gone (or going): its exit says how.
        """
        try:
            if isinstance(command, LoadModel):
                await self._load(command)
            else:
                for handle in self.ranks:
                    await handle.send(command)
        except RunnerGone:
            await raise_gone(self)

    async def _load(self, command: LoadModel) -> None:
        """Each rank its LoadModel, in the order the ring forms.

        Raises:
            RunnerGone: a rank died before it was warm (the group is going).
        """
        # Ports here are the kernel's free ones; on other machines a block of
        # base + offset + rank that no other group of ours holds.
        free = iter(free_ports(self.size))
        claimed = self._claim_remote_ports()
        if len(claimed) != sum(p.host is not None for p in self.places):
            await self._refuse("no free block of ports for the remote ranks")
        remote = iter(claimed)
        ports = [next(free) if p.host is None else next(remote) for p in self.places]
        hosts = [f"{place.ip}:{port}" for place, port in zip(self.places, ports, strict=True)]
        # The ranks here read the ring's host file from a directory that goes
        # with the group, whatever becomes of them; a remote rank writes its own.
        self._hostfile_dir = Path(tempfile.mkdtemp(prefix="mlx-supervisor-ring-"))
        hostfile = self._hostfile_dir / "hosts.json"
        hostfile.write_text(json.dumps([[host] for host in hosts]), encoding="utf-8")
        for handle in self.ranks:  # init holds the GIL: no pings answered while it blocks
            await first_of(handle.warm, self.exited)
            if not handle.warm.is_set():
                raise RunnerGone(handle.exit_info or ExitInfo(None, None, "rank exited"))
        plans = self._rank_plans(command.memory)
        problem = self._room_problem()
        if problem is not None:
            await self._refuse(problem)
        self.log.info("group_forming", hosts=hosts)
        for rank, (handle, place) in enumerate(zip(self.ranks, self.places, strict=True)):
            if rank == self.size - 1:  # (the local ones: a remote rank retries its connect)
                await self._wait_listening(ports[:-1])
            distributed = Distributed(
                rank,
                hosts,
                self.spec.distributed_backend,
                hostfile=str(hostfile) if place.host is None else None,
                join_timeout_s=self.config.group_join_s,
            )
            await handle.send(msgspec.structs.replace(command, memory=plans[rank],
                                                      distributed=distributed))  # fmt: skip

    def _rank_plans(self, plan: MemoryPlan | None) -> list[MemoryPlan | None]:
        """Each rank's memory plan. Admission's budget covers the ranks on
        this machine, which share it; a rank on another machine gets one
        rank's need and that machine's own total and guard."""
        here = sum(place.host is None for place in self.places)
        plans: list[MemoryPlan | None] = []
        for handle, place in zip(self.ranks, self.places, strict=True):
            if plan is None:
                plans.append(None)
            elif place.host is None:
                budget = plan.budget_bytes // here if plan.budget_bytes is not None else None
                plans.append(msgspec.structs.replace(plan, budget_bytes=budget))
            else:
                total = handle.machine_memory[0] or plan.total_bytes
                guard = self.config.memory_guard_bytes
                if guard is None:
                    guard = default_guard_bytes(total, total) if plan.guard_bytes else 0
                plans.append(MemoryPlan(total_bytes=total, budget_bytes=self.rank_need_bytes,
                                        guard_bytes=guard,
                                        threshold_pct=plan.threshold_pct))  # fmt: skip
        return plans

    def _room_problem(self) -> str | None:
        """Why another machine cannot take its ranks (as many as it hosts, each
        needing one rank's share), or None. Known once its ranks are warm."""
        need = self.rank_need_bytes
        if need is None:
            return None
        hosts: dict[str, list[RunnerHandle]] = {}
        for handle, place in zip(self.ranks, self.places, strict=True):
            if place.host is not None:
                hosts.setdefault(place.host, []).append(handle)
        for host, handles in hosts.items():
            total, available = handles[0].machine_memory
            if not total:
                continue
            problem = room_problem(host, total, available, need * len(handles),
                                   self.config.memory_guard_bytes)  # fmt: skip
            if problem is not None:
                return problem
        return None

    async def _refuse(self, problem: str) -> NoReturn:
        """End the load: the group is killed (by us, not by memory pressure
        here) and the load fails with ``problem``.

        Raises:
            RunnerGone: always.
        """
        self._failure = problem
        self.log.error("group_refused", reason=problem)
        for handle in self.ranks:
            handle.kill_cause = handle.kill_cause or problem
        await self._escalate(self.ranks, problem, first="sigkill")
        await self.exited.wait()
        raise RunnerGone(self.exit_info or ExitInfo(None, None, problem))

    def _claim_remote_ports(self) -> list[int]:
        """Ports for the remote ranks (``base + offset + rank``), in a block
        no live group of this daemon holds: MLX listens with SO_REUSEPORT, so
        two rings on one port would cross-wire silently."""
        remote = [r for r, p in enumerate(self.places) if p.host is not None]
        if not remote:
            return []
        global _NEXT_BLOCK
        base = self.config.distributed_port_base
        blocks = max(1, (65535 - base) // self.size)
        for step in range(blocks):
            # Blocks in turn, not the lowest free one: a remote rank of the
            # group before may still be on its way out, holding its port.
            block = (_NEXT_BLOCK + step) % blocks
            ports = [base + block * self.size + r for r in remote]
            if max(ports) < 65536 and not _REMOTE_PORTS_IN_USE.intersection(ports):
                _REMOTE_PORTS_IN_USE.update(ports)
                _NEXT_BLOCK = block + 1
                self._remote_ports = ports
                return ports
        return []

    async def _wait_listening(self, ports: list[int]) -> None:
        """Until ranks 0..N-2 listen on their ports (or one of them is gone:
        the load then fails by the group's exit)."""
        deadline = time.monotonic() + self.config.load_stall_s
        while not self.exited.is_set() and time.monotonic() < deadline:
            waiting = zip(self.ranks[: len(ports)], ports, strict=True)
            local = [(h, port) for h, port in waiting if h.host is None]
            if all(h.pid is not None and listening(h.pid, port) for h, port in local):
                return
            await anyio.sleep(LISTEN_POLL_S)

    async def _gather(self, rank: int, handle: RunnerHandle) -> None:
        """Pass one rank's load events on: progress as it comes, Ready once
        every rank is ready, the first LoadFailed."""
        while True:
            try:
                event = await handle.next_event()
            except RunnerGone:
                return
            if isinstance(event, Ready):
                self._readies[rank] = event
                if len(self._readies) == self.size:
                    self._events.put(self._merged_ready())
            elif isinstance(event, LoadFailed):
                if not self._load_failed:
                    self._load_failed = True
                    self._events.put(LoadFailed(f"rank {rank}: {event.error}"))
            elif isinstance(event, LoadProgress) or rank == 0:
                if isinstance(event, LoadProgress):
                    # A rank done loading waits in sharded_load's barrier for
                    # the slowest, and says nothing: the group's load moves.
                    for other in self.ranks:
                        if other is not handle and other.watchdog.phase == "loading":
                            other.watchdog.note_progress()
                self._events.put(event)
        # (the stream closes only after every gather has ended: see _run)

    def _merged_ready(self) -> Ready:
        readies = [self._readies[r] for r in range(self.size)]
        lead = readies[0]
        return msgspec.structs.replace(
            lead,
            param_bytes=sum(r.param_bytes for r in readies),
            active_bytes=sum(r.active_bytes for r in readies),
            peak_bytes=max(r.peak_bytes for r in readies),
            load_s=max(r.load_s for r in readies),
        )

    async def next_event(self) -> RunnerEvent:
        """The group's next load event (see :meth:`_gather`).

        Raises:
            RunnerGone: the group is gone.
        """
        return await self._events.next()

    def open_request(self, request_id: int) -> RequestStream:
        """Rank 0's frames of ``request_id``; when it ends, the group's exit.
        The other ranks follow the request too (their frames are dropped), so
        each rank's stall watchdog knows it is in prefill or decode."""
        for handle in self.ranks[1:]:
            handle.follow_request(request_id)
        stream = self.lead.open_request(request_id)
        stream.owner = self
        return stream

    def close_request(self, request_id: int, *, end: bool = True) -> None:
        for handle in self.ranks:
            handle.close_request(request_id, end=end)

    def expect(self, kind: type[Any], request_id: int | None = None) -> EventWaiter:
        return self.lead.expect(kind, request_id)

    # --- failure and stopping ------------------------------------------------

    async def _run(self) -> None:
        """The group's own task, a fault boundary: the ranks' load events
        gathered, and their deaths watched. When every rank is reaped (and
        its last events read), the group has exited."""
        try:
            async with anyio.create_task_group() as tg:
                for rank, handle in enumerate(self.ranks):
                    tg.start_soon(self._gather, rank, handle)
                await self._watch()
        except Exception as exc:
            self.log.exception("group_task_failed")
            self._failure = f"supervisor error: {exc!r}"
        finally:
            # A bug, or cancelled (the daemon stops): never leave a rank.
            live = [handle for handle in self.ranks if not handle.exited.is_set()]
            with anyio.CancelScope(shield=True):
                await self._escalate(live, "group stopped", first="sigkill")
            self.exit_info = self._describe_exit()
            self._events.close()
            if self._hostfile_dir is not None:
                shutil.rmtree(self._hostfile_dir, ignore_errors=True)
            _REMOTE_PORTS_IN_USE.difference_update(self._remote_ports)
            self.log.info("group_exited", first_dead=self.first_dead,
                          cause=self.exit_info.cause)  # fmt: skip
            self.exited.set()

    async def _watch(self) -> None:
        """On the first rank's death, tear the others down at once; return
        when every rank is reaped."""
        first = await first_of(*(handle.exited for handle in self.ranks))
        self.first_dead = first
        if not self.stop_requested:
            dead = self.ranks[first].exit_info
            self.log.warning("group_rank_died", rank=first,
                             cause=dead.cause if dead else None)  # fmt: skip
            # A Shutdown first: a rank inside a collective sees its peer gone
            # within milliseconds and says so in its exit audit; an idle one
            # exits at once. One that does not exit within a second is stuck
            # in a collective the backend never fails (it happens: "Failing
            # pending tasks..." and then nothing) and no signal handler can
            # run there: it is killed.
            await self._escalate(
                self.ranks,
                f"rank {first} of the group died",
                first="shutdown",
                shutdown_grace_s=PEER_EXIT_GRACE_S,
                term_grace_s=self.config.stall_kill_grace_s,
            )
        for handle in self.ranks:
            await handle.exited.wait()

    def _describe_exit(self) -> ExitInfo:
        """The first dead rank's exit, named, with every rank's exit (each
        classified: a rank that saw its peer go is ``peer_lost``)."""
        first = self.first_dead if self.first_dead is not None else 0
        exits = []
        for rank, handle in enumerate(self.ranks):
            info = handle.exit_info or ExitInfo(None, None, "never started")
            torn_down = rank != first or self.stop_requested
            cause_class = classify_exit(info, requested=False, under_pressure=False)
            if cause_class == "unknown" and torn_down:
                cause_class = "requested"
            exits.append(RankExit(rank, info.code, info.signal, info.cause, cause_class))
        lead = self.ranks[first].exit_info or ExitInfo(None, None, "never started")
        cause = f"rank {first}: {lead.cause}"
        if self._failure is not None:
            cause = f"{self._failure}; {cause}"
        return msgspec.structs.replace(lead, cause=cause, rank=first, ranks=exits)

    def signal(self, signum: signal.Signals) -> None:
        for handle in self.ranks:
            handle.signal(signum)

    async def _escalate(
        self,
        handles: Sequence[RunnerHandle],
        reason: str,
        *,
        first: Rung,
        term_grace_s: float | None = None,
        shutdown_grace_s: float | None = None,
    ) -> list[str]:
        """The kill ladder on each of ``handles`` (those spawned) at once;
        returns the longest ladder any needed."""
        steps: list[list[str]] = [[] for _ in handles]

        async def one(index: int, handle: RunnerHandle) -> None:
            if handle.process is None:
                return
            steps[index] = await handle.escalate(reason, first=first, term_grace_s=term_grace_s,
                                                 shutdown_grace_s=shutdown_grace_s)  # fmt: skip

        async with anyio.create_task_group() as tg:
            for index, handle in enumerate(handles):
                tg.start_soon(one, index, handle)
        return max(steps, key=len, default=[])

    async def escalate(
        self,
        reason: str,
        *,
        first: Rung = "shutdown",
        term_grace_s: float | None = None,
        shutdown_grace_s: float | None = None,
    ) -> list[str]:
        """The kill ladder on every rank at once; returns the longest ladder
        any rank needed, once the whole group is reaped."""
        if first == "shutdown":
            self.stop_requested = True
        steps = await self._escalate(self.ranks, reason, first=first, term_grace_s=term_grace_s,
                                     shutdown_grace_s=shutdown_grace_s)  # fmt: skip
        await self.exited.wait()
        return steps


# Checked by mypy: either serves a model where the registry holds a Runner.
_HANDLE_IS_A_RUNNER: type[Runner] = RunnerHandle
_GROUP_IS_A_RUNNER: type[Runner] = RunnerGroup
