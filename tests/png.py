"""A minimal PNG reader for tests: checks the structure, returns size and text chunks."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Png:
    width: int
    height: int
    text: dict[str, str]
    """tEXt, zTXt and iTXt chunks: keyword -> text."""


def read_png(path: Path) -> Png:
    """Parse ``path``; AssertionError if it is not a well-formed PNG (signature, IHDR
    first, every chunk's CRC, IDAT present, IEND last)."""
    data = path.read_bytes()
    assert data[:8] == SIGNATURE, f"{path} does not start with the PNG signature"
    pos, chunks = 8, []
    while pos < len(data):
        assert pos + 12 <= len(data), f"{path}: truncated chunk at byte {pos}"
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"{path}: bad CRC in chunk {kind!r}"
        chunks.append((kind, body))
        pos += 12 + length
    kinds = [k for k, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds, kinds
    width, height = struct.unpack(">II", chunks[0][1][:8])
    text = {}
    for kind, body in chunks:
        if kind == b"tEXt":
            key, value = body.split(b"\0", 1)
            text[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, value = body.split(b"\0", 1)
            text[key.decode("latin-1")] = zlib.decompress(value[1:]).decode("latin-1")
        elif kind == b"iTXt":
            key, rest = body.split(b"\0", 1)
            compressed, rest = rest[0], rest[2:]
            _, _, value = rest.split(b"\0", 2)
            text[key.decode("latin-1")] = (zlib.decompress(value) if compressed else value).decode(
                "utf-8"
            )
    return Png(width, height, text)
