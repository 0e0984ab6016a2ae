"""The bounded scan: a large frame's shape is checked before anything is built from it.

msgpack's own limits are per container (``max_array_len`` ...): they do not
bound how many containers a frame holds. An 8 MB frame of 4M one-element
arrays passes every per-container limit and costs ~3.5 s of decoding (and
hundreds of MiB) before any field can be checked. So a frame above
``SCAN_ABOVE_BYTES`` is walked first, byte by byte where it must and by
C-speed slices where it can, without creating a Python object per element:

- the top level is one map of at most ``MAX_FIELDS`` fields named by short
  strings;
- ``keys``, ``as_keys`` and ``pages`` are flat arrays of at most
  ``MAX_KEYS_PER_REQUEST`` scalars (keys of one length are checked in three
  slice compares, the vLLM case; keys of mixed lengths and page ids in one
  tight pass that also proves them valid, so ``requests.py`` need not check
  them again; any other list in one pass over its items, a table lookup each);
- everything else together holds at most ``MAX_OTHER_OBJECTS`` objects,
  nested at most ``MAX_DEPTH`` deep (the layout map is depth 2);
- no string over ``MAX_STR_BYTES``, no bin over ``MAX_BIN_BYTES``, no ext,
  no byte after the map.

A frame that passes is decoded once, by msgpack with the same limits
(``frames.unpack_map``), in time proportional to its few objects. Frames
up to ``SCAN_ABOVE_BYTES`` are decoded directly with lists of at most
``UNSCANNED_LIST_ITEMS`` items and bins of at most ``MAX_KEY_BYTES`` (a request's
only bins are keys), and scanned only when that fails: msgpack
allocates a list's slots when it reads its header, before any item, so with
lists of up to 16,384 items ~680 nested headers in 2 KiB cost ~15 ms before
it fails (2,700 in 8 KiB ~100 ms and tens of MiB); of 256, ~2 ms. The scan returns the request's ``id`` when it saw one, so even
a refused frame gets an addressed reply, and the list fields it proved to be
valid keys or page ids.
"""

from __future__ import annotations

from hisparse.protocol.codes import MAX_KEY_BYTES, MAX_KEYS_PER_REQUEST, MIN_KEY_BYTES, ErrorCode, WireError

SCAN_ABOVE_BYTES = 8 << 10  # frames larger than this are scanned before they are decoded
MAX_FIELDS = 32  # fields of a request map (the largest request has 10)
MAX_STR_BYTES = 4096  # any string: field names, namespace (256 chars), tokens, client text
MAX_OTHER_OBJECTS = 256  # objects outside the key and page lists (a hello has ~20)
MAX_DEPTH = 3  # request map -> layout map -> its values
MAX_BIN_BYTES = 256  # any bin; a key over MAX_KEY_BYTES (64) still decodes, so requests.py names it
LIST_FIELDS = frozenset({"keys", "as_keys", "pages"})
PAGE_FIELD = "pages"
# Lists of a frame decoded unscanned hold at most this many items (a longer one sends the frame
# to the scan, ~10 us more): each of up to 1,024 nested headers makes msgpack allocate 8 B a
# slot before it reads an item, so the worst 8 KiB costs ~2 ms here (~100 ms at 16,384). An
# 8 KiB lookup holds ~215 keys of 36 B: the usual requests stay off the scan.
UNSCANNED_LIST_ITEMS = 256

# Byte sizes of the fixed-width scalars: type byte -> payload bytes after it.
_FIXED = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8,
          0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8}
_INT_TYPES = {0xcc: False, 0xcd: False, 0xce: False, 0xcf: False,
              0xd0: True, 0xd1: True, 0xd2: True, 0xd3: True}
_BIN8 = 0xc4


def _steps() -> list[int]:
    """Bytes a list item takes, by its type byte, where the type byte alone tells (0: it does not)."""
    steps = [0] * 256
    for t in [*range(0x80), *range(0xe0, 0x100)]:
        steps[t] = 1
    for t in range(0xa0, 0xc0):  # fixstr: at most 31 bytes
        steps[t] = 1 + (t & 0x1f)
    for t, size in _FIXED.items():
        steps[t] = 1 + size
    return steps


_STEP = _steps()
# Bytes a bin8 item takes, by its length byte, where it is a key's length (0: it is not).
_KEY_STEP = [2 + size if MIN_KEY_BYTES <= size <= MAX_KEY_BYTES else 0 for size in range(256)]


def _refuse(message: str, rid: int | None) -> WireError:
    return WireError(ErrorCode.PROTOCOL_ERROR, f"frame refused unread: {message}", rid=rid)


class _Walker:
    def __init__(self, frame: bytes) -> None:
        self.b = frame
        self.pos = 0
        self.rid: int | None = None
        self.budget = MAX_OTHER_OBJECTS

    def need(self, n: int) -> int:
        start = self.pos
        if start + n > len(self.b):
            raise _refuse("truncated", self.rid)
        self.pos = start + n
        return start

    def uint(self, n: int) -> int:
        start = self.need(n)
        return int.from_bytes(self.b[start:start + n], "big")

    def container(self, t: int) -> tuple[str, int] | None:
        """('map' | 'array', length) when ``t`` starts a container, else None."""
        if 0x80 <= t <= 0x8f:
            return "map", t & 0x0f
        if 0x90 <= t <= 0x9f:
            return "array", t & 0x0f
        if t in (0xdc, 0xdd):
            return "array", self.uint(2 if t == 0xdc else 4)
        if t in (0xde, 0xdf):
            return "map", self.uint(2 if t == 0xde else 4)
        return None

    def scalar(self, t: int) -> None:
        """Skip one scalar whose type byte ``t`` was read; refuse containers and ext."""
        if t <= 0x7f or t >= 0xe0:
            return
        if 0xa0 <= t <= 0xbf:
            self.need(t & 0x1f)
            return
        if t in _FIXED:
            self.need(_FIXED[t])
            return
        if t in (0xd9, 0xda, 0xdb):
            n = self.uint({0xd9: 1, 0xda: 2, 0xdb: 4}[t])
            if n > MAX_STR_BYTES:
                raise _refuse(f"a string of {n} bytes (limit {MAX_STR_BYTES})", self.rid)
            self.need(n)
            return
        if t in (0xc4, 0xc5, 0xc6):
            n = self.uint({0xc4: 1, 0xc5: 2, 0xc6: 4}[t])
            if n > MAX_BIN_BYTES:
                raise _refuse(f"a bin of {n} bytes (limit {MAX_BIN_BYTES})", self.rid)
            self.need(n)
            return
        if 0xc7 <= t <= 0xc9 or 0xd4 <= t <= 0xd8:
            raise _refuse("an ext value (none is part of the protocol)", self.rid)
        if 0x80 <= t <= 0x9f or 0xdc <= t <= 0xdf:
            raise _refuse("a nested container where a scalar belongs", self.rid)
        raise _refuse(f"byte 0x{t:02x} begins no msgpack value", self.rid)

    def value(self, depth: int) -> None:
        """Skip one value of the budgeted kind (anything outside the key and page lists)."""
        self.budget -= 1
        if self.budget < 0:
            raise _refuse(f"more than {MAX_OTHER_OBJECTS} objects outside the key and page lists",
                          self.rid)
        t = self.b[self.need(1)]
        shape = self.container(t)
        if shape is None:
            self.scalar(t)
            return
        kind, n = shape
        if depth >= MAX_DEPTH:
            raise _refuse(f"containers nested deeper than {MAX_DEPTH}", self.rid)
        if n > self.budget:
            raise _refuse(f"a {kind} of {n} items outside the key and page lists", self.rid)
        for _ in range(n * 2 if kind == "map" else n):
            self.value(depth + 1)

    def field_name(self) -> str:
        t = self.b[self.need(1)]
        if 0xa0 <= t <= 0xbf:
            n = t & 0x1f
        elif t == 0xd9:
            n = self.uint(1)
        else:
            raise _refuse("a field name that is not a short string", self.rid)
        start = self.need(n)
        try:
            return self.b[start:start + n].decode()
        except UnicodeDecodeError:
            raise _refuse("a field name that is not UTF-8", self.rid) from None

    def request_id(self) -> None:
        """Read the ``id`` field's value (an int scalar) so a refusal can name it."""
        start = self.pos
        t = self.b[self.need(1)]
        if t <= 0x7f:
            self.rid = t
        elif t in _INT_TYPES:
            n = _FIXED[t]
            begin = self.need(n)
            value = int.from_bytes(self.b[begin:begin + n], "big", signed=_INT_TYPES[t])
            self.rid = value if value >= 0 else None
        else:
            self.pos = start
            self.value(1)

    def flat_list(self, name: str) -> bool:
        """A list field: at most MAX_KEYS_PER_REQUEST scalars, nothing nested.

        True when every item is proven what ``requests.py`` accepts in it: a
        key (1-MAX_KEY_BYTES bytes) in ``keys``/``as_keys``, a page id in ``pages``.
        """
        t = self.b[self.need(1)]
        shape = self.container(t)
        if shape is None or shape[0] != "array":
            self.pos -= 1  # not a list: requests.py names the wrong type
            self.value(1)
            return False
        n = shape[1]
        if n > MAX_KEYS_PER_REQUEST:
            raise WireError(ErrorCode.INVALID_ARGUMENT,
                            f"{n} items in {name}; the limit is {MAX_KEYS_PER_REQUEST}", rid=self.rid)
        if name == PAGE_FIELD:
            done = self._page_run(n)
        elif n and self._uniform_keys(n):
            done = n
        else:
            done = self._key_run(n)
        if done == n:
            return True
        self._items(n - done)
        return False

    def _items(self, n: int) -> None:
        """n scalars: fixed-size ones and short strings by a table lookup, bin8 inline, the
        rest through ``scalar``. ~0.1 us an item: this loop is what bounds a list's cost."""
        b, pos, step = self.b, self.pos, _STEP
        try:
            for _ in range(n):
                t = b[pos]
                size = step[t]
                if size:
                    pos += size
                elif t == _BIN8:  # at most 255 bytes: within MAX_BIN_BYTES
                    pos += 2 + b[pos + 1]
                else:
                    self.pos = pos + 1
                    self.scalar(t)
                    pos = self.pos
        except IndexError:
            raise _refuse("truncated", self.rid) from None
        if pos > len(b):
            raise _refuse("truncated", self.rid)
        self.pos = pos

    def _key_run(self, n: int) -> int:
        """How many of the next n items are keys (bin8 of MIN- to MAX_KEY_BYTES): one tight pass."""
        b, pos, i, steps = self.b, self.pos, 0, _KEY_STEP
        try:
            for i in range(n):
                if b[pos] != _BIN8:
                    break
                step = steps[b[pos + 1]]
                if not step:
                    break
                pos += step
            else:
                i = n
        except IndexError:
            pass  # the item at pos is cut short: _items names it
        if pos > len(b):
            raise _refuse("truncated", self.rid)
        self.pos = pos
        return i

    def _page_run(self, n: int) -> int:
        """How many of the next n items are page ids (ints 0-MAX_PAGE_ID, msgpack's shortest
        forms): one tight pass."""
        b, pos, i = self.b, self.pos, 0
        try:
            for i in range(n):
                t = b[pos]
                if t < 0x80:
                    pos += 1
                elif t == 0xcd:
                    pos += 3
                elif t == 0xce and b[pos + 1] < 0x80:  # below 2**31
                    pos += 5
                elif t == 0xcc:
                    pos += 2
                else:
                    break
            else:
                i = n
        except IndexError:
            pass
        if pos > len(b):
            raise _refuse("truncated", self.rid)
        self.pos = pos
        return i

    def _uniform_keys(self, n: int) -> bool:
        """n keys of one length as bin8, checked in three slice compares (no per-key Python)."""
        b, start = self.b, self.pos
        if start + 2 > len(b) or b[start] != _BIN8 or not 1 <= b[start + 1] <= MAX_KEY_BYTES:
            return False
        stride = 2 + b[start + 1]
        end = start + stride * n
        if end > len(b):
            return False
        if b[start:end:stride] != bytes((_BIN8,)) * n:
            return False
        if b[start + 1:end:stride] != bytes((stride - 2,)) * n:
            return False
        self.pos = end
        return True


def scan_request(frame: bytes) -> int | None:
    """Check a frame's shape without decoding it; returns its ``id`` when it names one.

    Raises ``WireError`` (``PROTOCOL_ERROR``, or ``INVALID_ARGUMENT`` for an
    over-long list), carrying the id when it came before the fault.
    """
    return scan_frame(frame)[0]


def scan_frame(frame: bytes) -> tuple[int | None, frozenset[str]]:
    """``scan_request``, and the list fields proven valid (``_Walker.flat_list``); a field
    named twice is proven only when every copy is (msgpack keeps the last)."""
    w = _Walker(frame)
    t = frame[w.need(1)]
    shape = w.container(t)
    if shape is None or shape[0] != "map":
        raise _refuse("a frame must be one map", None)
    if shape[1] > MAX_FIELDS:
        raise _refuse(f"a map of {shape[1]} fields (limit {MAX_FIELDS})", None)
    proven: dict[str, bool] = {}
    for _ in range(shape[1]):
        name = w.field_name()
        if name == "id":
            w.request_id()
        elif name in LIST_FIELDS:
            proven[name] = w.flat_list(name) and proven.get(name, True)
        else:
            w.value(1)
    if w.pos != len(frame):
        raise _refuse(f"{len(frame) - w.pos} bytes after the request map", w.rid)
    return w.rid, frozenset(name for name, ok in proven.items() if ok)


LEADING_FIELDS = 4  # ``encode_request`` writes v, id, op first: the id is among these
# What those fields may span: scalars of at most MAX_STR_BYTES (a string) each, and their names.
LEADING_HEAD_BYTES = 32 << 10


def leading_id(frame: bytes) -> int | None:
    """The ``id`` of a frame refused unread (a large frame over its sender's budget), when it
    is among the map's first ``LEADING_FIELDS`` fields with only scalars before it: a few
    bytes read, whatever the frame's size, so the refusal reaches the call that made it
    instead of leaving it to its timeout. None when it is not there, or the head is no
    request map: such a frame's sender gets an unaddressed reply, as before. ``frame`` may be
    any buffer (a frame refused unread is never copied whole): its head is read as bytes."""
    return leading_fields(frame)[0]


def leading_fields(frame: bytes) -> tuple[int | None, str | None]:
    """(``id``, ``op``) read from the head of a frame as ``leading_id`` reads the id: what a
    request refused unread is (a release is never refused for read-ahead), None for each
    not found there."""
    frame = bytes(frame[:LEADING_HEAD_BYTES])
    w = _Walker(frame)
    op = None
    try:
        shape = w.container(frame[w.need(1)])
        if shape is None or shape[0] != "map":
            return None, None
        for _ in range(min(shape[1], LEADING_FIELDS)):
            name = w.field_name()
            if name == "id":
                w.request_id()
            elif name == "op" and 0xa0 <= frame[w.pos] <= 0xbf:
                op = w.field_name()  # a short string, as every op's name is
            else:
                w.scalar(frame[w.need(1)])
            if w.rid is not None and op is not None:
                break
    except (WireError, IndexError):
        pass
    return w.rid, op
