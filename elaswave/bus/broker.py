"""The bus broker: a ZeroMQ XSUB/XPUB forwarder running in a background thread.

Publishers connect a PUB socket to :attr:`Broker.publish_endpoint` (the broker's XSUB);
subscribers connect a SUB socket to :attr:`Broker.subscribe_endpoint` (the broker's
XPUB). Subscriptions flow upstream through the proxy, so publishers only send what some
subscriber wants. The broker never decodes messages: validation is the clients' job, and
a malformed message costs the broker nothing.

The forwarding loop is libzmq's own ``zmq_proxy_steerable``, which releases the GIL. A
PAIR socket over ``inproc://`` steers it: :meth:`Broker.close` sends ``TERMINATE`` and
joins the thread, so shutdown is prompt and leaves no thread behind.

Example::

    with Broker() as broker:
        client = BusClient("core", broker.publish_endpoint, broker.subscribe_endpoint)
        ...
"""

from __future__ import annotations

import itertools
import threading
from types import TracebackType
from typing import Self

import structlog
import zmq
from zmq.auth.thread import ThreadAuthenticator

from elaswave.bus.keys import BusKeys, check_bind, serve_curve

logger = structlog.get_logger(__name__)

DEFAULT_HWM = 100_000
"""High-water mark (messages) on both broker sockets."""

_ids = itertools.count()


class Broker:
    """XSUB/XPUB proxy bound on ``host``; ports are chosen by the OS when left at 0.

    Args:
        host: interface to bind, as an IP address.
        frontend_port: port of the XSUB socket publishers connect to (0: any free port).
        backend_port: port of the XPUB socket subscribers connect to (0: any free port).
        hwm: send/receive high-water mark of both sockets, in messages.
        keys: CURVE keys (:mod:`elaswave.bus.keys`): both sockets then encrypt and admit
            only clients holding the job's client key. Required to bind beyond loopback.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        frontend_port: int = 0,
        backend_port: int = 0,
        *,
        hwm: int = DEFAULT_HWM,
        keys: BusKeys | None = None,
    ) -> None:
        if hwm <= 0:
            raise ValueError(f"hwm must be a positive number of messages, got {hwm}")
        check_bind(host, keyed=keys is not None)
        self._keys = keys
        self._auth: ThreadAuthenticator | None = None
        self._host = host
        self._frontend_port = frontend_port
        self._backend_port = backend_port
        self._hwm = hwm
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._control: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._publish_endpoint: str | None = None
        self._subscribe_endpoint: str | None = None
        self._closed = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ endpoints

    @property
    def publish_endpoint(self) -> str:
        """``tcp://host:port`` of the XSUB socket: connect PUB sockets here."""
        if self._publish_endpoint is None:
            raise RuntimeError("Broker.publish_endpoint is only known after start()")
        return self._publish_endpoint

    @property
    def subscribe_endpoint(self) -> str:
        """``tcp://host:port`` of the XPUB socket: connect SUB sockets here."""
        if self._subscribe_endpoint is None:
            raise RuntimeError("Broker.subscribe_endpoint is only known after start()")
        return self._subscribe_endpoint

    @property
    def running(self) -> bool:
        """True while the forwarding thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Self:
        """Bind both sockets and start forwarding in a daemon thread; returns ``self``."""
        with self._lock:
            if self._closed:
                raise RuntimeError("Broker was closed; create a new one")
            if self._thread is not None:
                raise RuntimeError("Broker.start() called twice")
            context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
            frontend = context.socket(zmq.XSUB)
            backend = context.socket(zmq.XPUB)
            control_server = context.socket(zmq.PAIR)
            control_client = context.socket(zmq.PAIR)
            sockets = (frontend, backend, control_server, control_client)
            try:
                frontend.setsockopt(zmq.RCVHWM, self._hwm)
                frontend.setsockopt(zmq.SNDHWM, self._hwm)
                backend.setsockopt(zmq.RCVHWM, self._hwm)
                backend.setsockopt(zmq.SNDHWM, self._hwm)
                for sock in sockets:
                    sock.setsockopt(zmq.LINGER, 0)
                if self._keys is not None:
                    self._auth = ThreadAuthenticator(context)
                    self._auth.start()
                    # Admits the public keys of the key directory: the job's client key.
                    self._auth.configure_curve(domain="*", location=str(self._keys.directory))
                    serve_curve(frontend, self._keys)
                    serve_curve(backend, self._keys)
                frontend.bind(f"tcp://{self._host}:{self._frontend_port}")
                backend.bind(f"tcp://{self._host}:{self._backend_port}")
                control_address = f"inproc://elaswave-broker-{next(_ids)}"
                control_server.bind(control_address)
                control_client.connect(control_address)
            except zmq.ZMQError as exc:
                for sock in sockets:
                    sock.close()
                if self._auth is not None:
                    self._auth.stop()
                context.term()
                raise RuntimeError(
                    f"broker could not bind on {self._host} (ports {self._frontend_port}, "
                    f"{self._backend_port}): {exc}"
                ) from exc
            self._publish_endpoint = _last_endpoint(frontend)
            self._subscribe_endpoint = _last_endpoint(backend)
            self._context = context
            self._control = control_client
            self._thread = threading.Thread(
                target=self._forward,
                args=(frontend, backend, control_server),
                name="elaswave-bus-broker",
                daemon=True,
            )
            self._thread.start()
        logger.debug(
            "broker_started",
            publish_endpoint=self._publish_endpoint,
            subscribe_endpoint=self._subscribe_endpoint,
        )
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop forwarding, join the thread and release the sockets. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread, control, context = self._thread, self._control, self._context
            self._thread = self._control = self._context = None
        if thread is not None and control is not None:
            if thread.is_alive():
                control.send(b"TERMINATE")
            thread.join(timeout)
            if thread.is_alive():
                logger.error("broker_thread_did_not_stop", timeout_s=timeout)
            control.close()
        if self._auth is not None:
            self._auth.stop()
        if context is not None and (thread is None or not thread.is_alive()):
            context.term()
        logger.debug("broker_closed")

    def __enter__(self) -> Self:
        if self._thread is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ thread body

    @staticmethod
    def _forward(
        frontend: zmq.Socket[bytes], backend: zmq.Socket[bytes], control: zmq.Socket[bytes]
    ) -> None:
        try:
            zmq.proxy_steerable(frontend, backend, None, control)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.ETERM:
                logger.exception("broker_proxy_failed")
        finally:
            for sock in (frontend, backend, control):
                sock.close(linger=0)


def _last_endpoint(sock: zmq.Socket[bytes]) -> str:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()
