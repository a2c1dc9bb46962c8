"""A pre-forked starter of the job's processes, so that a Core (first or restarted) and a
worker start in milliseconds instead of importing Python and torch again (1.5-3 s each
on a loaded 2-core host).

``elaswave train`` forks the zygote before it starts any thread or event loop, with what
it loaded for the job (torch, the model's library), and so does each other host's agent
for that host's workers (:mod:`elaswave.runtime.host.workers`). The zygote,
single-threaded, loads the Core's and the worker's modules and what torch loads on first
use (:data:`LAZY_IMPORTS`), then forks one process per request. A request names the kind
(``core`` or ``worker``) and its arguments and carries, as SCM_RIGHTS, its output's file
descriptor (and a Core's end of the host link). The zygote answers ``{"pid": P}`` and,
when it has reaped a process, ``{"exit": P, "code": C}`` (``-signal`` for a signal). It
dies with the host; its children die with it. Without a zygote (``run_job`` called from
a program), or with a ``worker_prefix`` (a command must run in front of each worker),
the host execs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
from typing import Any

from elaswave.runtime.job.child import die_with_parent, exit_now
from elaswave.runtime.job.hostlink import LINK_FD_ENV


class Zygote:
    """The host's handle on its zygote."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self._sock = sock
        self._buffer = b""
        self._lock: asyncio.Lock | None = None
        self._replies: asyncio.Queue[int] | None = None
        self._exits: dict[int, asyncio.Future[int]] = {}
        self._codes: dict[int, int] = {}
        self._reader: asyncio.Task[None] | None = None

    @classmethod
    def start(cls) -> Zygote:
        """Fork the zygote. Call before any thread or event loop exists."""
        sys.stdout.flush()  # nothing buffered may be written twice
        sys.stderr.flush()
        host_end, zygote_end = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the zygote
            host_end.close()
            code = 0
            try:
                _serve(zygote_end)
            except BaseException:  # interrupted, or the host is gone
                code = 1
            exit_now(code)
        zygote_end.close()
        host_end.setblocking(False)
        return cls(pid, host_end)

    async def spawn(
        self, kind: str, argv: list[str], env: dict[str, str | None], fds: list[int]
    ) -> int:
        """Fork a ``kind`` process (``core``: ``fds`` = [its host link, its output];
        ``worker``: [its output]) running its module's ``main(argv)`` with ``env``
        applied (None unsets). Returns its pid."""
        if self._reader is None:
            self._lock, self._replies = asyncio.Lock(), asyncio.Queue()
            self._reader = asyncio.create_task(self._read(), name="zygote")
        assert self._lock is not None
        assert self._replies is not None
        request = json.dumps({"kind": kind, "argv": argv, "env": env}).encode()
        async with self._lock:  # answers come in the order of the requests
            socket.send_fds(self._sock, [request], fds)
            return await self._replies.get()

    async def wait(self, pid: int) -> int:
        """The exit code of ``pid`` (``-signal`` when a signal ended it)."""
        if pid in self._codes:
            return self._codes.pop(pid)
        waiter = self._exits.setdefault(pid, asyncio.get_running_loop().create_future())
        return await waiter

    async def _read(self) -> None:
        assert self._replies is not None
        while True:
            answer = await self._next()
            if "pid" in answer:
                self._replies.put_nowait(int(answer["pid"]))
            elif (waiter := self._exits.pop(int(answer["exit"]), None)) is not None:
                waiter.set_result(int(answer["code"]))
            else:
                self._codes[int(answer["exit"])] = int(answer["code"])

    async def _next(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        while b"\n" not in self._buffer:
            data = await loop.sock_recv(self._sock, 65536)
            if not data:
                raise RuntimeError("the process starter (zygote) has gone")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close()
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)


class ForkedProcess:
    """A worker the zygote forked, with what the host uses of ``asyncio.subprocess.Process``."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    async def wait(self) -> int:
        if self.returncode is None:
            self.returncode = await self._zygote.wait(self.pid)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


LAZY_IMPORTS = (
    "torch.fx.experimental.symbolic_shapes",  # by every backward (torch.autograd), 0.8 s
    "torch.utils.serialization",  # by torch.save
    "numpy.random",
)
"""Modules torch and numpy import on first use, during a worker's first step: loaded
once, here, instead of by every worker while its pipeline waits for it."""


def _serve(sock: socket.socket) -> None:
    die_with_parent()
    from elaswave.runtime.core import process as coreproc  # loaded once, here, for every child
    from elaswave.runtime.worker import process as worker

    for name in LAZY_IMPORTS:
        importlib.import_module(name)

    # Every object loaded so far (torch, the model code) is the children's for good:
    # a full collection in a child then scans only what the child made, instead of
    # pausing a recovery for the whole heap (and copying every page it touches).
    gc.freeze()

    mains = {"core": coreproc.main, "worker": worker.main}

    def send(doc: dict[str, Any]) -> None:
        sock.sendall(json.dumps(doc).encode() + b"\n")

    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        if readable:
            message, fds, _, _ = socket.recv_fds(sock, 65536, 2)
            if not message:
                return  # the host closed its end
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                sock.close()
                _child(mains[request["kind"]], request, fds)
            for fd in fds:
                os.close(fd)
            send({"pid": pid})
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _child(main: Any, request: dict[str, Any], fds: list[int]) -> None:
    *link, out_fd = fds
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    for name, value in request["env"].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if link:
        os.environ[LINK_FD_ENV] = str(link[0])
    code = 1
    try:
        code = main(request["argv"])
    finally:
        exit_now(code)
