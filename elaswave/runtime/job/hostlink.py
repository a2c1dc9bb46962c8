"""The link between the job host and the Core: worker processes, owned by the host.

The job host (the ``elaswave train`` process) owns what must outlive a Core: the
torch.distributed store and the worker processes. The Core runs in a child process and
sees the workers only through this link, a socket pair carrying one JSON object per line:

host -> Core: ``{"op": "table", "workers": {RANK: {"pid": P, "code": C|null}}}`` once on
connect (a restarted Core adopts the workers it finds there), then ``started`` (a worker
the Core asked for is up: rank, pid) and ``exited`` (rank, code: its exit status, or
``-signal``).

Core -> host: ``spawn`` (rank, join), ``signal`` (rank, signal number), and ``observe``
(the bus is up: the host attaches its observer of the job's events and answers
``observing``).

A Core that dies leaves the link closed; the host keeps its workers and their exit codes
and gives the next Core the table.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import json
import signal
import socket
from typing import Any

import structlog

log = structlog.get_logger(__name__)

LINK_FD_ENV = "ELASWAVE_HOST_LINK_FD"
"""Environment variable naming the Core's end of the link (an inherited descriptor)."""


class LinkOp(enum.StrEnum):
    """The ``op`` of a host-link message (plain strings in the JSON)."""

    TABLE = "table"
    """host -> Core, once on connect: every worker's pid and exit code (null: running)."""
    STARTED = "started"
    """host -> Core: a worker the Core asked for is up (rank, pid)."""
    SPAWN_FAILED = "spawn_failed"
    """host -> Core: a worker the Core asked for could not be started (rank, error)."""
    EXITED = "exited"
    """host -> Core: a worker exited (rank, code: its exit status, or ``-signal``)."""
    OBSERVING = "observing"
    """host -> Core: the answer to ``observe``."""
    SPAWN = "spawn"
    """Core -> host: start a worker (rank, join)."""
    SIGNAL = "signal"
    """Core -> host: signal a worker (rank, signal number). SIGTERM asks a worker to
    leave (a joiner of a job that is over): its exit is no failure to restart."""
    OBSERVE = "observe"
    """Core -> host: the bus is up, attach the observer of the job's events."""


class LinkClosed(RuntimeError):
    """The other end of the link has gone."""


class ProcessHandle(abc.ABC):
    """A worker process owned elsewhere, with what ``asyncio.subprocess.Process`` offers
    its user (``pid``, ``returncode``, ``wait``, ``kill``, ``terminate``); a subclass
    says how a signal reaches it."""

    def __init__(self, rank: int, pid: int, code: int | None = None) -> None:
        self.rank = rank
        self.pid = pid
        self.returncode: int | None = code
        self._exited = asyncio.Event()
        if code is not None:
            self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is not None:
            raise ProcessLookupError(f"rank {self.rank} (pid {self.pid}) has exited")
        self._signal(int(signum))

    @abc.abstractmethod
    def _signal(self, signum: int) -> None:
        """Deliver ``signum`` to the process (through whatever owns it)."""

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        """Ask the process to leave: no failure (:attr:`LinkOp.SIGNAL`)."""
        self.send_signal(signal.SIGTERM)

    def exited(self, code: int) -> None:
        """The process exited with ``code`` (the first report counts)."""
        if self.returncode is None:
            self.returncode = code
            self._exited.set()


class WorkerHandle(ProcessHandle):
    """A worker process seen from the Core, signalled through the host link."""

    def __init__(self, link: CoreLink, rank: int, pid: int, code: int | None = None) -> None:
        super().__init__(rank, pid, code)
        self._link = link

    def _signal(self, signum: int) -> None:
        self._link.send({"op": LinkOp.SIGNAL, "rank": self.rank, "signal": signum})


async def _read_lines(reader: asyncio.StreamReader) -> dict[str, Any]:
    line = await reader.readline()
    if not line:
        raise LinkClosed("the other end of the host link closed it")
    doc = json.loads(line)
    if not isinstance(doc, dict) or not isinstance(doc.get("op"), str):
        raise ValueError(f"host link message is not an object with an op: {line[:200]!r}")
    return doc


class CoreLink:
    """The Core's end: the worker table, spawn requests, and exits as they happen."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.workers: dict[int, WorkerHandle] = {}
        self._started: dict[int, asyncio.Future[WorkerHandle]] = {}
        self._task: asyncio.Task[None] | None = None
        self._observing = asyncio.Event()

    @classmethod
    def from_fd(cls, fd: int) -> CoreLink:
        return cls(socket.socket(fileno=fd))

    async def connect(self) -> dict[int, WorkerHandle]:
        """Read the host's worker table; return the handles of its workers."""
        self._reader, self._writer = await asyncio.open_connection(sock=self._sock)
        first = await _read_lines(self._reader)
        if first["op"] != LinkOp.TABLE:
            raise ValueError(f"host link: expected the worker table first, got {first['op']!r}")
        for rank, entry in first["workers"].items():
            self.workers[int(rank)] = WorkerHandle(self, int(rank), entry["pid"], entry["code"])
        self._task = asyncio.create_task(self._receive(), name="host-link")
        return dict(self.workers)

    def send(self, doc: dict[str, Any]) -> None:
        if self._writer is None or self._writer.is_closing():
            raise LinkClosed("the host link is not connected")
        self._writer.write(json.dumps(doc).encode() + b"\n")

    async def spawn(self, rank: int, *, join: bool) -> WorkerHandle:
        """Ask the host to start worker ``rank``; return its handle once it runs."""
        started = asyncio.get_running_loop().create_future()
        self._started[rank] = started
        self.send({"op": LinkOp.SPAWN, "rank": rank, "join": join})
        return await started

    async def observe(self, timeout_s: float = 10.0) -> None:
        """The bus is up: let the host attach its observer before the first event."""
        self.send({"op": LinkOp.OBSERVE})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._observing.wait(), timeout_s)

    async def _receive(self) -> None:
        assert self._reader is not None
        try:
            while True:
                doc = await _read_lines(self._reader)
                rank = int(doc.get("rank", -1))
                if doc["op"] == LinkOp.STARTED:
                    handle = self.workers[rank] = WorkerHandle(self, rank, int(doc["pid"]))
                    if (waiter := self._started.pop(rank, None)) is not None:
                        waiter.set_result(handle)
                elif doc["op"] == LinkOp.EXITED and rank in self.workers:
                    self.workers[rank].exited(int(doc["code"]))
                elif doc["op"] == LinkOp.OBSERVING:
                    self._observing.set()
                elif doc["op"] == LinkOp.SPAWN_FAILED:
                    if (waiter := self._started.pop(rank, None)) is not None:
                        waiter.set_exception(RuntimeError(str(doc.get("error"))))
                else:
                    log.warning("core.host_link_unknown", message=doc)
        except LinkClosed:
            log.error("core.host_link_lost")
            raise

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._writer.wait_closed()


class HostLink:
    """The host's end, for one Core incarnation: serve its requests with ``spawn`` and
    ``signal``, tell it of starts and exits."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.StreamReader | None = None

    async def open(self, table: dict[int, dict[str, Any]]) -> None:
        self._reader, self._writer = await asyncio.open_connection(sock=self._sock)
        self.send({"op": LinkOp.TABLE, "workers": {str(r): e for r, e in table.items()}})

    def send(self, doc: dict[str, Any]) -> None:
        """Best effort: a Core that has gone misses nothing the next one is not given."""
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(json.dumps(doc).encode() + b"\n")

    async def requests(self) -> Any:
        """The Core's requests, until it closes the link (or dies)."""
        assert self._reader is not None
        while True:
            try:
                doc = await _read_lines(self._reader)
            except (LinkClosed, ConnectionError):
                return
            except ValueError as exc:
                log.error("host.bad_core_request", error=str(exc))
                continue
            yield doc

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
