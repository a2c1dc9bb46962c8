"""TensorBoard scalars of a job, written by its host beside summary.json.

``RUN_DIR/tensorboard/events.out.tfevents.*`` holds, per step, ``train/loss`` and
``train/samples_per_s``; per change of plan, ``recovery/mttr_s`` (at the redone step),
``plan/ranks`` (the ranks training after it) and ``plan/changes`` (a running count), so
that a dashboard shows where a failure, a slow rank or a join changed the job and what it
cost. ``tensorboard --logdir RUN_DIR/tensorboard`` reads it.

The file is TensorBoard's own format, written here without TensorFlow or the tensorboard
package (neither is a dependency of a training job): a TFRecord stream (each record a
length, its masked CRC-32C, the payload and its masked CRC-32C) of ``Event`` protocol
buffers (``wall_time``, ``step``, a ``Summary`` of ``simple_value`` scalars), beginning
with the ``file_version`` event every reader expects.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

from elaswave.bus.schema import Event, RecoveryFinished, RunStarted, StepCompleted
from elaswave.rundir import TENSORBOARD


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord checksums its records."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _field(number, 2) + _varint(len(payload)) + payload


def event_proto(*, wall_time: float, step: int = 0, scalars: dict[str, float] | None = None,
                file_version: str | None = None) -> bytes:  # fmt: skip
    """A serialized ``tensorflow.Event``: wall_time (1, double), step (2, int64),
    file_version (3, string) or summary (5, ``Summary``: repeated value (1) of tag (1,
    string) and simple_value (2, float))."""
    out = _field(1, 1) + struct.pack("<d", wall_time) + _field(2, 0) + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(
            _bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5) + struct.pack("<f", v))
            for tag, v in scalars.items()
        )
        out += _bytes_field(5, values)
    return out


def record(payload: bytes) -> bytes:
    """One TFRecord: length, masked CRC of the length, payload, masked CRC of it."""
    length = struct.pack("<Q", len(payload))
    return (
        length
        + struct.pack("<I", _masked(crc32c(length)))
        + payload
        + struct.pack("<I", _masked(crc32c(payload)))
    )


class ScalarLog:
    """The job's scalars as TensorBoard events; call it with every observed bus event."""

    def __init__(self, run_dir: Path) -> None:
        directory = run_dir / TENSORBOARD
        directory.mkdir(parents=True, exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.elaswave"
        self.path = directory / name
        self._file = self.path.open("ab")
        self._write(event_proto(wall_time=now, file_version="brain.Event:2"))
        self.changes = 0
        self.ranks = 0

    def _write(self, payload: bytes) -> None:
        self._file.write(record(payload))
        self._file.flush()

    def scalars(self, step: int, values: dict[str, float], wall_time: float | None = None) -> None:
        when = wall_time if wall_time else time.time()
        self._write(event_proto(wall_time=when, step=step, scalars=values))

    def __call__(self, event: Event) -> None:
        if isinstance(event, StepCompleted):
            rate = event.samples / event.step_time_s if event.step_time_s > 0 else 0.0
            values = {"train/loss": event.loss, "train/samples_per_s": rate}
            if event.lr > 0:
                values["train/lr"] = event.lr
            if event.clipped:
                values["train/grad_norm"] = event.grad_norm
            if event.evaluated:
                values["eval/loss"] = event.eval_loss
            self.scalars(event.step, values, event.time)
        elif isinstance(event, RunStarted):
            self.ranks = event.world_size
            self.scalars(0, {"plan/ranks": float(self.ranks)}, event.time)
        elif isinstance(event, RecoveryFinished):
            self.changes += 1
            if event.kind == "fail-stop":
                self.ranks -= len(event.ranks)
            self.ranks += (
                len(event.joined) if event.joined or event.kind != "join" else len(event.ranks)
            )
            values = {
                "recovery/mttr_s": event.mttr_s,
                "plan/changes": float(self.changes),
                "plan/ranks": float(self.ranks),
            }
            self.scalars(event.step, values, event.time)

    def close(self) -> None:
        self._file.close()
