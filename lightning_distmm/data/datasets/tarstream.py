"""The members of a tar stream, read with as little Python per member as the format allows.

Every distmm rank reads every sample of a WebDataset stream (:mod:`lightning_distmm.data.streams.streaming`),
so the cost of reading a member is paid once per rank per sample of the global batch. The standard
library's ``tarfile`` iterator (what ``webdataset``'s tar iterators use) spends ~120 us of Python per
header on the demo shards (pax headers, two per member); this reader takes the three kinds of
header the shard writers emit (POSIX ustar, pax extended headers, GNU long names) and skips others,
at about an eighth of that (docs/data.md). Anything it cannot read is an error naming the shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO

BLOCK = 512
_REGULAR = (b"0", b"\0", b"7")  # regular file, old-style regular file, contiguous file


def tar_members(f: IO[bytes], url: str, data: bool = True) -> Iterator[tuple[str, bytes | None]]:
    """``(name, contents)`` of each regular member of the tar stream ``f``, in order.

    Args:
        f: a binary stream at the start of the archive (a file, or ``webdataset``'s ``gopen`` pipe).
        url: what to name in errors.
        data: False: seek over the contents (``f`` must be seekable) and yield None for them.
    """
    pax: dict[bytes, bytes] = {}
    long_name: str | None = None
    offset = 0
    while True:
        header = f.read(BLOCK)
        if not header or header.count(0) == BLOCK:  # end of archive (or a stream cut at a member's end)
            return
        if len(header) < BLOCK:
            raise ValueError(f"{url}: truncated tar header at byte {offset}")
        if _checksum(header) != _number(header[148:156], url, offset):
            raise ValueError(f"{url}: bad tar header checksum at byte {offset}: not a tar file, or a damaged one")
        kind = header[156:157]
        size = (
            int(pax[b"size"]) if b"size" in pax and kind not in (b"x", b"g") else _number(header[124:136], url, offset)
        )
        padded = size + (-size % BLOCK)
        offset += BLOCK + padded
        if kind in (b"x", b"g", b"L", b"K"):  # pax (per file, global), GNU long name, long link
            payload = _read(f, padded, url, offset)[:size]
            if kind == b"x":
                pax = _pax_records(payload, url, offset)
            elif kind == b"L":
                long_name = payload.rstrip(b"\0").decode("utf-8", "surrogateescape")
            continue
        name = pax[b"path"].decode("utf-8", "surrogateescape") if b"path" in pax else long_name or _ustar_name(header)
        pax, long_name = {}, None
        if kind not in _REGULAR:
            _skip(f, padded, url, offset)
            continue
        if data:
            yield name, _read(f, padded, url, offset)[:size]
        else:
            f.seek(padded, 1)
            yield name, None


def _checksum(header: bytes) -> int:
    return 256 + sum(header[:148]) + sum(header[156:])  # the checksum field counted as spaces


def _number(field: bytes, url: str, offset: int) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 (sizes of 8 GiB and more)
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise ValueError(f"{url}: bad number {field!r} in the tar header at byte {offset}: not a tar file?") from None


def _ustar_name(header: bytes) -> str:
    name = header[:100].split(b"\0", 1)[0]
    if header[257:263] == b"ustar\0":  # POSIX: a prefix field (GNU uses those bytes for other things)
        prefix = header[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


def _pax_records(payload: bytes, url: str, offset: int) -> dict[bytes, bytes]:
    """``length key=value\\n`` records."""
    out: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(payload) and payload[pos : pos + 1] != b"\0":
        space = payload.find(b" ", pos)
        if space < 0:
            raise ValueError(f"{url}: bad pax header before byte {offset}")
        length = int(payload[pos:space])
        key, _, value = payload[space + 1 : pos + length - 1].partition(b"=")
        out[key] = value
        pos += length
    return out


def _read(f: IO[bytes], n: int, url: str, offset: int) -> bytes:
    data = f.read(n)
    if len(data) < n:
        raise ValueError(f"{url}: the tar stream ends inside a member (before byte {offset}): a truncated shard")
    return data


def _skip(f: IO[bytes], n: int, url: str, offset: int) -> None:
    if n:
        _read(f, n, url, offset)


__all__ = ["tar_members"]
