"""Embed ElasWave's event loop beside your own training loop.

    .venv/bin/python examples/embed_training.py

The script plays three parts in one process:
- the Core's bus broker (in a real job the Core hosts it; attach with elaswave.connect),
- a user's plain PyTorch training loop, with an ElasWave Session running its uvloop
  event loop in a background thread: the loop publishes a StepCompleted event per step
  (never blocking), and a callback pauses training at the next step boundary while a
  recovery is under way,
- a dashboard on the user's own asyncio loop, reading events with ``async for``.
An "operator" announces a recovery at step 4 and its end a moment later.
"""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from elaswave import logs
from elaswave.bus.broker import Broker
from elaswave.bus.schema import (
    EventKind,
    RecoveryFinished,
    RecoveryStarted,
    StepCompleted,
)
from elaswave.bus.session import Session

STEPS = 8
_PRINTING = threading.Lock()


def say(line: str) -> None:
    """Print one whole line: the callback (the session's thread), the dashboard (its own
    loop's thread) and the training loop print concurrently, and ``print`` writes a
    line's text and its newline apart."""
    with _PRINTING:
        print(line, flush=True)


def main() -> None:
    logs.configure()
    with Broker() as broker:
        endpoints = (broker.publish_endpoint, broker.subscribe_endpoint)
        trainer = Session("trainer", *endpoints)
        operator = Session("operator", *endpoints)

        # 1. A callback: runs on the session's thread; keep it short.
        resume = threading.Event()
        resume.set()

        def on_recovery(event) -> None:
            if event.KIND is EventKind.RECOVERY_STARTED:
                say(f"[callback] recovery started at step {event.step}: {event.reason}")
                resume.clear()
            else:
                say(f"[callback] recovery finished, MTTR {event.mttr_s:.2f} s")
                resume.set()

        trainer.subscribe(
            on_recovery, kinds=[EventKind.RECOVERY_STARTED, EventKind.RECOVERY_FINISHED]
        )

        # 2. An async iterator, consumed on the user's own asyncio loop.
        seen: list[int] = []

        async def dashboard() -> None:
            async for event in trainer.events(kinds=[EventKind.STEP_COMPLETED]):
                seen.append(event.step)
                say(f"[dashboard] step {event.step} loss {event.loss:.4f}")

        trainer.start()
        operator.start()
        watcher = threading.Thread(target=asyncio.run, args=(dashboard(),), daemon=True)
        watcher.start()

        # 3. The user's own training loop.
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(64, 16), torch.randn(64, 1)
        for step in range(STEPS):
            resume.wait(timeout=30)  # step boundary: wait out a recovery
            started = time.perf_counter()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            trainer.publish(
                StepCompleted(
                    sender="trainer",
                    rank=0,
                    step=step,
                    loss=loss.item(),
                    step_time_s=time.perf_counter() - started,
                    samples=64,
                )
            )
            if step == 3:
                operator.publish(
                    RecoveryStarted(
                        sender="operator",
                        step=4,
                        kind="fail-stop",
                        ranks=[5],
                        reason="rank 5 stopped heartbeating",
                    )
                )
                time.sleep(0.3)
                operator.publish(
                    RecoveryFinished(
                        sender="operator", step=4, kind="fail-stop", ranks=[5], mttr_s=0.3
                    )
                )
            time.sleep(0.05)
        time.sleep(0.3)
        operator.close()
        trainer.close()  # ends the dashboard's async iterator
        watcher.join(timeout=5)
        say(f"trained {STEPS} steps; dashboard saw steps {seen}")


if __name__ == "__main__":
    main()
