"""A pre-forked starter of Core processes, so that a Core (and a restarted one) starts in
milliseconds instead of importing torch again (1.5-2 s on a loaded 2-core host).

``elaswave train`` forks the zygote before it starts any thread or event loop; the
zygote, single-threaded, forks one Core per request. A request carries the Core's
arguments and, as SCM_RIGHTS, its end of the host link and the write end of its log
pipe. The zygote answers ``{"pid": P}`` and, when it has reaped that Core,
``{"exit": P, "code": C}`` (``-signal`` for a signal). It dies with the host; each Core
dies with the zygote. Without a zygote (``run_job`` called from a program), the host
starts the Core with exec, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import socket
from typing import Any

from elaswave.runtime.child import die_with_parent, exit_now
from elaswave.runtime.hostlink import LINK_FD_ENV


class Zygote:
    """The host's handle on its zygote (one Core at a time)."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self._sock = sock
        self._buffer = b""

    @classmethod
    def start(cls) -> Zygote:
        """Fork the zygote. Call before any thread or event loop exists."""
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
        self, argv: list[str], env: dict[str, str | None], *, link_fd: int, out_fd: int
    ) -> int:
        """Fork a Core running ``coreproc.main(argv)`` with ``env`` applied (None
        unsets); its stdout and stderr go to ``out_fd``. Returns its pid."""
        request = json.dumps({"argv": argv, "env": env}).encode()
        socket.send_fds(self._sock, [request], [link_fd, out_fd])
        answer = await self._next()
        return int(answer["pid"])

    async def wait(self, pid: int) -> int:
        """The exit code of Core ``pid`` (``-signal`` when a signal ended it)."""
        while True:
            answer = await self._next()
            if answer.get("exit") == pid:
                return int(answer["code"])

    async def _next(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        while b"\n" not in self._buffer:
            data = await loop.sock_recv(self._sock, 65536)
            if not data:
                raise RuntimeError("the Core starter (zygote) has gone")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        self._sock.close()
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)


def _serve(sock: socket.socket) -> None:
    die_with_parent()
    from elaswave.runtime import coreproc  # loaded once, here, for every Core

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
            if pid == 0:  # a Core
                sock.close()
                link_fd, out_fd = fds
                os.dup2(out_fd, 1)
                os.dup2(out_fd, 2)
                os.close(out_fd)
                for name, value in request["env"].items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
                os.environ[LINK_FD_ENV] = str(link_fd)
                code = 1
                try:
                    code = coreproc.main(request["argv"])
                finally:
                    exit_now(code)
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
