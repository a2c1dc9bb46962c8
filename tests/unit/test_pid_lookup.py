"""A kill-node fault looks up its node peers' process ids on a store connection of its
own: a wait another thread left blocked on the worker's connection (a group creation a
torn apply abandoned) does not hold the node's kill until the store's timeout."""

from __future__ import annotations

import contextlib
import threading
import time

from elaswave.comm.store import connect_store, serve_store
from elaswave.runtime.worker.process import pid_lookup


def test_a_pid_lookup_does_not_wait_behind_a_blocked_wait_on_the_workers_connection():
    server = serve_store(timeout_s=10.0)
    store = connect_store("127.0.0.1", server.port, timeout_s=10.0)
    store.set("pid/3", "4242")
    blocked = threading.Thread(target=lambda: _wait_quietly(store), daemon=True)
    blocked.start()
    time.sleep(0.3)  # the thread is inside its wait, holding the connection
    pid_of = pid_lookup(store)
    started = time.monotonic()
    assert pid_of(3) == 4242 and pid_of(5) is None  # 5 never started
    assert time.monotonic() - started < 2.0
    connect_store("127.0.0.1", server.port).set("never", "1")  # release the blocked wait
    blocked.join(10.0)


def _wait_quietly(store) -> None:
    with contextlib.suppress(Exception):  # timed out: what the test avoids
        store.wait(["never"])
