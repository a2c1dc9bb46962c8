"""The Core's log service: receivers fetch the messages they missed on the bus.

The Core records every message it receives; :class:`LogIndex` keeps the last
:data:`~elaswave.bus.reliable.HISTORY` of each of the Core's topics and the last
:data:`KEPT_OF_OTHERS` of each other (sender, topic), by number. A
:class:`LogService` answers fetches on a ROUTER socket in a background thread, beside the
broker and under the same bind rule and CURVE keys. A worker that sees a gap in some
sender's numbers (:class:`~elaswave.bus.reliable.SeqTracker`) asks with :func:`fetch`,
gets the raw frames back, and decodes them like any other message: nothing fetched is
trusted more than what the bus delivers.

Wire format (msgpack maps; one request frame, one reply frame after the ROUTER envelope)::

    request: {"id": N, "want": [[sender, topic, [seq, ...]], ...]}
    reply:   {"id": N, "frames": [[topic_frame, payload_frame], ...]}

    request: {"id": N, "have": [[sender, topic, [seq, ...]], ...]}
    reply:   {"id": N, "missing": [[sender, topic, [seq, ...]], ...]}

    request: {"id": N, "last": [[sender, topic, []], ...]}
    reply:   {"id": N, "last": [[sender, topic, seq], ...]}

    any:     {"id": N, "error": "what was wrong with the request"}

The second asks which of a sender's messages the Core lacks: a worker about to exit
publishes those again (:meth:`~elaswave.bus.client.BusClient.flush`), since after it
exits no one can. The third asks for a sender's highest number held (0: none): the
Core logs each of its own messages before sending it, so for the Core that is its last
number, where a client that connects starts counting it
(:meth:`~elaswave.bus.client.BusClient.connect`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack
import structlog
import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from elaswave.bus.envelope import CORE_SENDER
from elaswave.bus.keys import BusKeys, check_bind, serve_curve, use_curve
from elaswave.bus.reliable import FLUSH_WINDOW, HISTORY, RELIABLE_TOPICS

logger = structlog.get_logger(__name__)

MAX_REQUEST_BYTES = 64 * 1024
MAX_REPLY_MESSAGES = 1024

_OPS = ("want", "have", "last")
"""What a request asks for (the name of its one list): messages, which of them the Core
lacks, the last numbers it holds."""
_ONE_OF_OPS = "a 'want', 'have' or 'last' list"


Frames = list[bytes]
"""A message's multipart frames."""

KEPT_OF_OTHERS = 2 * FLUSH_WINDOW
"""Messages per (sender, topic) the index keeps of a process other than the Core. Workers
fetch the Core's messages from it; another's are asked for by an observer (the job host)
within a second of a gap, and checked by their sender's :meth:`flush` (its last
:data:`FLUSH_WINDOW`, so never fewer). Kept like the Core's (:data:`HISTORY`), the step
metrics of 200 ranks took 379 MiB of the Core's memory after 2048 steps (1.85 GiB at
1000 ranks)."""

FETCHED = frozenset(topic.value for topic in RELIABLE_TOPICS)
"""The topics whose messages are fetched, checked and counted (the reliable ones): the
index keeps only theirs. Health messages (heartbeats, five a second a rank, and step
timings) were kept too and never asked for: at 64 ranks half of the index's memory."""


class LogIndex:
    """The last ``size`` messages of every (sender, topic) of the Core's (``owner``), and
    the last ``others`` of everyone else's, by number, on the :data:`FETCHED` topics;
    thread-safe."""

    def __init__(
        self, size: int = HISTORY, *, others: int = KEPT_OF_OTHERS, owner: str = CORE_SENDER
    ) -> None:
        if others < FLUSH_WINDOW:
            raise ValueError(
                f"a log index keeping {others} messages of a sender would never hold a "
                f"client's last {FLUSH_WINDOW}, which its flush checks: keep at least that"
            )
        self._size = size
        self._others = others
        self._owner = owner
        self._lock = threading.Lock()
        self._messages: dict[tuple[str, str], collections.OrderedDict[int, Frames | None]] = {}
        """(sender, topic) -> seq -> its frames (None: held in the event log only, after
        a restore that kept the frames of the newest only: :meth:`load`)."""

    def add(self, sender: str, topic: str, seq: int, frames: Sequence[bytes]) -> None:
        if seq <= 0 or topic not in FETCHED:
            return
        with self._lock:
            kept = self._messages.setdefault((sender, topic), collections.OrderedDict())
            kept[seq] = [bytes(f) for f in frames]
            self._trim(sender, kept)

    def _trim(self, sender: str, kept: collections.OrderedDict[int, Frames | None]) -> None:
        size = self._size if sender == self._owner else self._others
        while len(kept) > size:
            kept.popitem(last=False)

    def export(self, recent: int) -> list[tuple[str, str, list[int], list[tuple[int, Frames]]]]:
        """Every message kept, as plain data: (sender, topic, numbers, [(seq, frames),
        ...]), with the frames of all of the owner's messages and of the newest
        ``recent`` of each other (sender, topic); of older ones, their numbers only."""
        out = []
        with self._lock:
            for (sender, topic), kept in self._messages.items():
                cut = 0 if sender == self._owner else max(0, len(kept) - recent)
                items = list(kept.items())
                numbers = [seq for seq, _ in items[:cut]]
                framed = [(seq, f) for seq, f in items[cut:] if f is not None]
                numbers += [seq for seq, f in items[cut:] if f is None]
                out.append((sender, topic, sorted(numbers), framed))
        return out

    def load(self, kept: Iterable[tuple[str, str, list[int], list[tuple[int, Frames]]]]) -> None:
        """Take in what :meth:`export` gave: the messages given by number only are held
        (a sender's flush finds them) and not served (a receiver asks for a gap within
        a second of it, of the newest messages)."""
        with self._lock:
            for sender, topic, numbers, framed in kept:
                if topic not in FETCHED:
                    continue
                entries = self._messages.setdefault((sender, topic), collections.OrderedDict())
                merged = {**dict.fromkeys(numbers), **dict(framed)}
                entries.update((seq, merged[seq]) for seq in sorted(merged))
                self._trim(sender, entries)

    def get(self, sender: str, topic: str, seqs: Iterable[int]) -> list[list[bytes]]:
        with self._lock:
            kept = self._messages.get((sender, topic))
            if kept is None:
                return []
            return [frames for s in seqs if (frames := kept.get(s)) is not None]

    def lacks(self, sender: str, topic: str, seqs: Iterable[int]) -> list[int]:
        with self._lock:
            kept = self._messages.get((sender, topic))
            return list(seqs) if kept is None else [s for s in seqs if s not in kept]

    def last(self, sender: str, topic: str) -> int:
        """The highest number held of (``sender``, ``topic``); 0 when none is."""
        with self._lock:
            kept = self._messages.get((sender, topic))
            return 0 if kept is None else max(kept, default=0)


def _answer(index: LogIndex, body: bytes) -> dict[str, Any]:
    """The reply to one request; a bad request gets an error naming what was wrong."""
    if len(body) > MAX_REQUEST_BYTES:
        return {"id": None, "error": f"request of {len(body)} bytes, over {MAX_REQUEST_BYTES}"}
    try:
        request = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:
        return {"id": None, "error": f"undecodable request ({type(exc).__name__})"}
    if not isinstance(request, dict):
        return {"id": None, "error": f"request must be a map with {_ONE_OF_OPS}"}
    op = next((op for op in _OPS if op in request), _OPS[0])
    items = request.get(op)
    if not isinstance(items, list):
        return {"id": request.get("id"), "error": f"request must have {_ONE_OF_OPS}"}
    frames: list[list[bytes]] = []
    missing: list[list[Any]] = []
    last: list[list[Any]] = []
    for item in items:
        ok = isinstance(item, list) and len(item) == 3
        if ok:
            sender, topic, seqs = item
            ok = isinstance(sender, str) and isinstance(topic, str) and isinstance(seqs, list)
            ok = ok and all(type(s) is int for s in seqs)
        if not ok:
            return {"id": request.get("id"), "error": f"bad {op} entry {item!r:.80}"}
        if op == "want":
            frames.extend(index.get(sender, topic, seqs))
        elif op == "last":
            last.append([sender, topic, index.last(sender, topic)])
        elif lacked := index.lacks(sender, topic, seqs):
            missing.append([sender, topic, lacked])
    if op == "have":
        return {"id": request.get("id"), "missing": missing}
    if op == "last":
        return {"id": request.get("id"), "last": last}
    return {"id": request.get("id"), "frames": frames[:MAX_REPLY_MESSAGES]}


class LogService:
    """Answer fetches from ``index`` on a ROUTER socket bound on ``host`` (``port`` 0:
    any free port)."""

    def __init__(
        self,
        index: LogIndex,
        host: str = "127.0.0.1",
        *,
        keys: BusKeys | None = None,
        port: int = 0,
    ) -> None:
        check_bind(host, keyed=keys is not None)
        self.index = index
        self._host = host
        self._port = port
        self._keys = keys
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._auth: ThreadAuthenticator | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.endpoint = ""
        self.served = 0

    def start(self) -> LogService:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._keys is not None:
            self._auth = ThreadAuthenticator(context)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(self._keys.directory))
            serve_curve(sock, self._keys)
        try:
            sock.bind(f"tcp://{self._host}:{self._port}")
        except zmq.ZMQError as exc:
            sock.close()
            if self._auth is not None:
                self._auth.stop()
            context.term()
            raise RuntimeError(
                f"log service could not bind on {self._host} (port {self._port}): {exc}"
            ) from exc
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        self.endpoint = endpoint.decode()
        self._context = context
        self._thread = threading.Thread(
            target=self._serve, args=(sock,), name="elaswave-log-service", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self._auth is not None:
            self._auth.stop()
        if self._context is not None:
            self._context.term()
            self._context = None

    def _serve(self, sock: zmq.Socket[bytes]) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(100, zmq.POLLIN):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 2:
                    continue  # not a DEALER request: nothing to answer to
                identity, body = frames
                reply = _answer(self.index, body)
                if "error" in reply:
                    logger.warning("log_service_bad_request", error=reply["error"])
                self.served += 1
                sock.send_multipart([identity, msgpack.packb(reply, use_bin_type=True)])
        finally:
            sock.close(linger=0)


class Fetcher:
    """A receiver's side: ask the log service for missing messages (asyncio)."""

    def __init__(self, endpoint: str, *, keys: BusKeys | None = None) -> None:
        self.endpoint = endpoint
        self._keys = keys
        self._sock: zmq.asyncio.Socket | None = None
        self._ids = itertools.count(1)
        self._one_at_a_time = asyncio.Lock()
        """Held from a request to its reply: a client's repairs (``maintain``) and its
        :meth:`~elaswave.bus.client.BusClient.flush` share the socket, and two readers
        waiting at once can each take the other's reply and drop it as an old one."""

    async def fetch(
        self, want: dict[tuple[str, str], list[int]], timeout_s: float
    ) -> list[list[bytes]]:
        """Frames of the wanted messages the Core has ([] on timeout or error)."""
        reply = await self._ask("want", want, timeout_s)
        frames = None if reply is None else reply.get("frames")
        return [list(f) for f in frames if isinstance(f, list)] if isinstance(frames, list) else []

    async def lacking(
        self, have: dict[tuple[str, str], list[int]], timeout_s: float
    ) -> dict[tuple[str, str], list[int]] | None:
        """Which of ``have`` the Core lacks (None: no answer in time)."""
        reply = await self._ask("have", have, timeout_s)
        if reply is None or not isinstance(reply.get("missing"), list):
            return None
        return {
            (m[0], m[1]): m[2]
            for m in reply["missing"]
            if isinstance(m, list) and len(m) == 3 and isinstance(m[2], list)
        }

    async def last(
        self, keys: Iterable[tuple[str, str]], timeout_s: float
    ) -> dict[tuple[str, str], int] | None:
        """The highest number the Core holds of each (sender, topic) of ``keys``, 0 for
        none (None: no answer in time)."""
        reply = await self._ask("last", {key: [] for key in keys}, timeout_s)
        if reply is None or not isinstance(reply.get("last"), list):
            return None
        return {
            (m[0], m[1]): m[2]
            for m in reply["last"]
            if isinstance(m, list) and len(m) == 3 and type(m[2]) is int
        }

    async def _ask(
        self, op: str, items: dict[tuple[str, str], list[int]], timeout_s: float
    ) -> dict[str, Any] | None:
        if self._sock is None:
            self._sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            if self._keys is not None:
                use_curve(self._sock, self._keys)
            self._sock.connect(self.endpoint)
        request_id = next(self._ids)
        body = {"id": request_id, op: [[s, t, seqs] for (s, t), seqs in items.items()]}
        try:
            async with asyncio.timeout(timeout_s), self._one_at_a_time:
                await self._sock.send(msgpack.packb(body, use_bin_type=True))
                while True:
                    reply = msgpack.unpackb(await self._sock.recv(), raw=False)
                    if isinstance(reply, dict) and reply.get("id") == request_id:
                        break  # older ids: answers to requests that timed out
        except TimeoutError:
            return None
        except Exception as exc:  # an undecodable reply: the Core's log is not usable
            logger.warning("bus_fetch_failed", endpoint=self.endpoint, error=str(exc))
            return None
        if "error" in reply:
            logger.warning("bus_fetch_refused", endpoint=self.endpoint, error=reply["error"])
            return None
        return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
