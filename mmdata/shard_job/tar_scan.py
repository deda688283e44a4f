"""List the regular-file members of a tar by parsing its 512-byte headers directly.

Why: `tarfile` builds a full TarInfo per header (a dozen field conversions, two checksum sums),
which made listing the biggest CPU cost per record in the Infinity-MM scan. This lister reads
only the headers (member data is skipped by offset arithmetic) and does the minimum needed for
(name, data offset, size). Anything it cannot reproduce exactly — a damaged or truncated file,
sparse members, unknown header types, unusual pax records — makes it list that whole file with
`tarfile` instead, plus one check tarfile lacks: a listing that does not end at the
end-of-archive marker (a file cut at a header boundary, a damaged header) is reported, not
silently taken as the end of the file.
"""

from __future__ import annotations

import os
import re
import tarfile
import zlib
from typing import NamedTuple

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
_MAX_EXTENSION = 1 << 20  # longer GNU long-name / pax data is left to tarfile
_FILE_TYPES = (b"0", b"7")  # REGTYPE, CONTTYPE (AREGTYPE b"\0": see _is_file)
_OTHER_TYPES = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, dirs, fifos: no data
_NUMERIC_FIELDS = ((100, 108), (108, 116), (116, 124), (124, 136), (136, 148), (148, 156), (329, 337), (337, 345))
# The numeric fields as tarfile / GNU tar / bsdtar write them; anything else is checked by
# tarfile's own parser (`_numbers_exact`), which also reads base-256 numbers.
_OCT8 = rb"(?:[0-7]{7}[\0 ]|[0-7]{6} \0|\0{8})"
_CANONICAL = re.compile(rb"(?s)" + _OCT8 * 3 + rb"([0-7]{11})[\0 ][0-7]{11}[\0 ]([0-7]{6})\0 .{173}" + _OCT8 * 2)


class TarMember(NamedTuple):
    """A regular-file member: its data is bytes [offset_data, offset_data + size) of the tar.
    (A NamedTuple because one is built per member on the hot path.)"""

    name: str
    offset_data: int
    size: int


class TarListing(NamedTuple):
    members: list[TarMember]
    tail_error: str  # "" for a complete tar; else what stopped the listing, and where


class _Unusual(Exception):
    """The fast path cannot reproduce tarfile here; list the file with tarfile."""


def list_tar(path: str) -> TarListing:
    """Regular-file members in archive order, like iterating `tarfile.open(path, "r:")` and
    keeping `isfile()` members. Raises tarfile.ReadError when the file is not a tar at all."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            return TarListing(_scan(fd, os.fstat(fd).st_size), "")
        finally:
            os.close(fd)
    except (_Unusual, OSError):
        return _list_with_tarfile(path)


def list_tar_range(path: str, start: int, stop: int) -> list[TarMember] | None:
    """The regular-file members whose headers lie in bytes [start, stop) of a well-formed tar,
    e.g. a run of samples whose offsets energon's `.tar.idx` gives, so that reading a few samples
    of a big shard costs those samples, not the shard. None wherever the fast path would not list
    exactly those members (the range does not start and end at headers, an unusual header, an
    unreadable file): the caller then lists the whole file."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            return _scan(fd, os.fstat(fd).st_size, start, stop)
        finally:
            os.close(fd)
    except (_Unusual, OSError):
        return None


def _list_with_tarfile(path: str) -> TarListing:
    """The reference listing: what tarfile yields, plus a note when the file is cut short."""
    members: list[TarMember] = []
    tail_error = ""
    with tarfile.open(path, "r:") as tar:
        try:
            for m in tar:
                if m.isfile():
                    members.append(TarMember(m.name, m.offset_data, m.size))
        except (tarfile.TarError, EOFError, OSError) as e:
            tail_error = f"tar listing stopped after {len(members)} members: {type(e).__name__}: {e}"
        stop = tar.offset  # the header position where tarfile's listing ended
    # tarfile silently ends the listing at a cut-short or damaged header; detect that here.
    size = os.path.getsize(path)
    if not tail_error and members and members[-1].offset_data + members[-1].size > size:
        tail_error = f"file ends inside member {members[-1].name!r}: truncated tar ({size} bytes)"
    elif not tail_error:
        with open(path, "rb") as f:
            f.seek(stop)
            block = f.read(BLOCK)
        if block != _ZERO_BLOCK:
            what = (
                "the file ends"
                if not block
                else "the file ends inside a header"
                if len(block) < BLOCK
                else "an unreadable header (bad checksum or damaged) follows"
            )
            tail_error = (
                f"no end-of-archive marker after {len(members)} members: {what} at byte {stop} "
                f"of {size}; the file was cut short or damaged there"
            )
    return TarListing(members, tail_error)


def _scan(fd: int, file_size: int, offset: int = 0, stop: int | None = None) -> list[TarMember]:
    """Walk the headers of a well-formed tar (from the header at `offset` to the one at `stop`,
    or to the end-of-archive marker); raise _Unusual wherever tarfile would do more than list
    members (stop early, raise, or apply an extension we do not model), or the walk does not
    land on `stop`."""
    members: list[TarMember] = []
    long_name: str | None = None  # from a GNU 'L' header, for the next member
    long_link = False  # a GNU 'K' header was seen for the next member
    pax: dict[str, bytes] | None = None  # records of a pax 'x' header, for the next member
    while True:
        pending = long_name is not None or long_link or pax is not None
        if offset == stop:
            if pending:
                raise _Unusual("range ends after an extension header")
            return members
        buf = os.pread(fd, BLOCK, offset)
        if len(buf) < BLOCK:  # no end-of-archive marker: reported by the tarfile listing
            raise _Unusual("truncated header")
        if buf == _ZERO_BLOCK:
            if pending or stop is not None:
                raise _Unusual("end of archive after an extension header")
            return members
        size, kind = _parse_header(buf)
        data = offset + BLOCK
        if kind in (b"L", b"K", b"x", b"g"):
            ext = _read_extension(fd, data, size)
            if kind == b"L" and long_name is None and pax is None:
                long_name = ext.split(b"\0", 1)[0].decode(tarfile.ENCODING, "surrogateescape")
            elif kind == b"K" and not long_link and pax is None:
                long_link = True
            elif kind == b"x" and not pending:
                pax = _pax_records(ext, size)
            elif kind == b"g" and not pending:
                _check_global(_pax_records(ext, size))
            else:
                raise _Unusual(f"unsupported sequence of extension headers at {offset}")
            offset = data + _padded(size)
        else:
            is_file = _is_file(kind, buf)
            if pax is not None:
                long_name, size = _apply_pax(pax, long_name, size)
            if is_file:
                name = long_name if long_name is not None else _member_name(buf)
                members.append(TarMember(name, data, size))
                offset = data + _padded(size)
            else:
                offset = data
            long_name, long_link, pax = None, False, None
        if offset > file_size or (stop is not None and offset > stop):
            raise _Unusual("file (or range) ends inside member data")


def _parse_header(buf: bytes) -> tuple[int, bytes]:
    """(size, type flag) of a header that tarfile would accept; _Unusual otherwise."""
    m = _CANONICAL.match(buf, 100)
    size, chksum = (int(m[1], 8), int(m[2], 8)) if m else _numbers_exact(buf)
    if size < 0 or not _checksum_ok(buf, chksum):
        raise _Unusual("bad header")
    return size, buf[156:157]


def _numbers_exact(buf: bytes) -> tuple[int, int]:
    """(size, checksum) via tarfile's own number parser, for fields not in the canonical form."""
    try:
        size, chksum = tarfile.nti(buf[124:136]), tarfile.nti(buf[148:156])
        for lo, hi in _NUMERIC_FIELDS:
            tarfile.nti(buf[lo:hi])
    except tarfile.InvalidHeaderError:
        raise _Unusual("invalid number field") from None
    return size, chksum


def _checksum_ok(buf: bytes, chksum: int) -> bool:
    """tarfile's check (unsigned or signed byte sum, checksum field counted as spaces).
    For ASCII headers both sums agree and stay below 65521, so adler32's low half is the sum + 1."""
    if buf.isascii():
        return chksum == (zlib.adler32(buf) & 0xFFFF) + 255 - sum(buf[148:156])
    return chksum in tarfile.calc_chksums(buf)


def _is_file(kind: bytes, buf: bytes) -> bool:
    """tarfile's isfile() for a member header; _Unusual for types whose data it may treat apart."""
    if kind in _FILE_TYPES:
        return True
    if kind == b"\0":
        return not _raw_name(buf).endswith(b"/")  # a v7 directory is AREGTYPE + trailing slash
    if kind in _OTHER_TYPES:
        return False
    raise _Unusual(f"header type {kind!r}")


def _raw_name(buf: bytes) -> bytes:
    return buf[:100].split(b"\0", 1)[0]


def _member_name(buf: bytes) -> str:
    """The name field, joined to the ustar prefix field when that is set (as tarfile does)."""
    name = _raw_name(buf).decode(tarfile.ENCODING, "surrogateescape")
    if buf[345] == 0:
        return name
    prefix = buf[345:500].split(b"\0", 1)[0].decode(tarfile.ENCODING, "surrogateescape")
    return f"{prefix}/{name}"


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _read_extension(fd: int, offset: int, size: int) -> bytes:
    """The padded data blocks of an extension header (GNU long name, pax records)."""
    if size > _MAX_EXTENSION:
        raise _Unusual("oversized extension header")
    return os.pread(fd, _padded(size), offset)


def _pax_records(ext: bytes, size: int) -> dict[str, bytes]:
    """Well-formed `"<len> <key>=<value>\\n"` records; _Unusual for anything tarfile might read
    differently (malformed records, records in the padding, a hdrcharset record)."""
    if len(ext) < size or b"hdrcharset=" in ext or ext[size : size + 1].isdigit():
        raise _Unusual("unusual pax header")
    records: dict[str, bytes] = {}
    pos = 0
    while pos < size:
        space = ext.find(b" ", pos, size)
        length = int(ext[pos:space]) if space > pos and ext[pos:space].isdigit() else 0
        record = ext[space + 1 : pos + length]
        key, eq, value = record.partition(b"=")
        if length <= 0 or pos + length > size or not record.endswith(b"\n") or not eq or not key:
            raise _Unusual("malformed pax record")
        records[key.decode("utf-8", "surrogateescape")] = value[:-1]
        pos += length
    return records


def _check_global(records: dict[str, bytes]) -> None:
    """A pax global header is harmless unless it renames, resizes or sparsifies members."""
    if any(k in ("path", "size") or k.startswith("GNU.sparse.") for k in records):
        raise _Unusual("pax global header changes members")


def _apply_pax(records: dict[str, bytes], name: str | None, size: int) -> tuple[str | None, int]:
    """The `path` and `size` records override the header (tarfile's rules: trailing slashes
    stripped from the path, an unparsable size reads as 0)."""
    if any(k.startswith("GNU.sparse.") for k in records):
        raise _Unusual("pax sparse file")
    if "path" in records:
        name = _pax_text(records["path"]).rstrip("/")
    if "size" in records:
        try:
            size = int(records["size"].decode("utf-8", "surrogateescape"))
        except ValueError:
            size = 0
        if size < 0:
            raise _Unusual("negative pax size")
    return name, size


def _pax_text(value: bytes) -> str:
    """tarfile's decoding of a pax path: UTF-8, else the file-system encoding."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode(tarfile.ENCODING, "surrogateescape")
