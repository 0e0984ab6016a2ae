"""Sessions, their holds, and the fences that outlive them.

A session is opened by ``hello`` and bound to the ZeroMQ connection that
sent it: an id presented on another connection is unknown. It lives while it
is heard from (any request renews its lease). Its holds are typed records:
reservations by key (one page each, WRITING), pins by page (a count each),
so a key re-stored after ``clear`` and pinned again is a second record, not
a corrupted one.

When a session ends (``bye``, lease expiry, a daemon restart) its holds are
gone, but its pages are not free: the process may be stalled, not dead, and
still copy into or out of them. The session becomes a ``Zombie`` that keeps
its pages fenced (reserved pages FENCED, pins held) until its fence file's
lock is free (``hisparse.shm.fence``): every process that may touch the pages
has exited or let go. Only then are they freed. ``evict_session`` frees them
on an operator's word.

Session ids are random 62-bit numbers; logs and stats show only an 8-digit
handle (the id's first hex digits), never the id itself.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from hisparse.daemon.policy.peers import Peer, uid_of_pid
from hisparse.daemon.policy.proclocks import lock_holders
from hisparse.daemon.store.calltags import CallTags
from hisparse.daemon.store.namespaces import Namespace, Registry
from hisparse.errors import InvalidArgument
from hisparse.shm.fence import FENCE_SUFFIX, LOST, FenceFile

log = logging.getLogger(__name__)


def fence_paths(fence_dir: str) -> Iterator[str]:
    """The fence files in ``fence_dir``, listed lazily (a directory of many costs no list)."""
    with os.scandir(fence_dir) as entries:
        for entry in entries:
            if entry.name.endswith(FENCE_SUFFIX):
                yield entry.path


def handle_of(session_id: int) -> str:
    """The public name of a session: the first 8 of its 16 hex digits."""
    return f"{session_id:016x}"[:8]


@dataclass
class PinHold:
    key: bytes  # the key the page held when pinned (for logs; unpin goes by page)
    count: int


@dataclass
class Session:
    id: int
    namespace: Namespace | None  # None: an admin session (hisparsectl)
    client: str
    peer: bytes  # ZeroMQ routing id of the connection that said hello
    fence: FenceFile | None  # None for admin sessions, which hold nothing
    opened_s: float
    last_seen_s: float
    fence_verified: bool = False  # the client's lock on its fence was seen once
    reservations: dict[bytes, int] = field(default_factory=dict)  # key -> page (WRITING)
    pins: dict[int, PinHold] = field(default_factory=dict)  # page -> hold
    tags: CallTags = field(default_factory=CallTags)  # which call took which hold (calltags)
    owner: Peer = field(default_factory=lambda: Peer(None, None, None))  # quotas count by its key

    @property
    def handle(self) -> str:
        return handle_of(self.id)

    def held_pages(self) -> tuple[int, int]:
        """(reserved, pinned) pages, as quotas count them."""
        return len(self.reservations), len(self.pins)

    def describe(self) -> str:
        ns = self.namespace.name if self.namespace else "(admin)"
        return f"session {self.handle} [{self.client or 'anonymous'}] on {ns}"

    @property
    def pinned_pages(self) -> int:
        return len(self.pins)


@dataclass
class Zombie:
    """An ended session whose pages stay fenced while any process may still touch them."""

    handle: str
    namespace: Namespace
    client: str
    fence: FenceFile
    reason: str  # "lease expired", "bye", "daemon restart"
    ended_s: float
    opened_unix_s: float
    fenced_pages: list[int]  # its reservations: FENCED, never visible, not reusable
    pins: dict[int, int]  # page -> pins still held for it
    owner: Peer | None = None  # None: adopted from an earlier run (counted against nobody)

    def held_pages(self) -> tuple[int, int]:
        """(fenced, pinned) pages: still held for the peer that owned the session."""
        return len(self.fenced_pages), len(self.pins)

    def describe(self) -> str:
        return (f"session {self.handle} [{self.client or 'anonymous'}] on {self.namespace.name} "
                f"({self.reason})")

    def release(self) -> tuple[int, int]:
        """Free its pages: (fenced pages freed, pins dropped)."""
        index = self.namespace.index
        for page in self.fenced_pages:
            index.release_fenced(page)
        index.unpin_many(list(self.pins), list(self.pins.values()))
        dropped = sum(self.pins.values())
        self.fence.close(unlink=True)
        return len(self.fenced_pages), dropped


FOREIGN_CHECK_INTERVAL_S = 1.0  # /proc/locks is read at most this often (it lists every lock)


def only_foreign_holders(pids: list[int], uid: int) -> bool:
    """True when every holder is known and none runs as ``uid``, the session's own user.

    Another user's process cannot be copying for the session (it was never told the
    fence's name, nor can it map a restricted region); holding the lock is all it can do.
    A holder the daemon cannot place (another PID namespace, /proc unreadable) counts as
    the session's own: its pages stay fenced.
    """
    if not pids:
        return False
    uids = [uid_of_pid(pid) for pid in pids]
    return all(u is not None and u != uid for u in uids)


class SessionTable:
    def __init__(self, lease_ttl_s: float, clock=time.monotonic) -> None:
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock
        self.sessions: dict[int, Session] = {}
        self.zombies: dict[str, Zombie] = {}  # fence name -> zombie
        self._owned: dict[object, dict[object, Session | Zombie]] = {}  # peer key -> its holders
        self._peer_pins: dict[tuple[object, str], dict[int, int]] = {}  # -> page: sessions pinning it
        self._foreign_checked_s = float("-inf")  # when /proc/locks was last read for foreign holders
        self.expired_total = 0
        self.zombies_released_total = 0
        self.limits = None  # hisparse.daemon.policy.limits.Limits: admits and counts sessions (None: no caps)

    # -- live sessions --

    def open(self, namespace: Namespace | None, client: str, peer: bytes = b"",
             fence_dir: str | None = None, owner: Peer | None = None) -> Session:
        if self.limits is not None:  # QUOTA_EXCEEDED naming the cap, before anything is made
            self.limits.admit_session(peer, len(self.sessions), len(self.zombies))
        now = self._clock()
        sid = secrets.randbits(62)
        while sid in self.sessions or sid == 0:
            sid = secrets.randbits(62)
        fence = None
        owner = owner if owner is not None else Peer(None, None, None, peer)
        if namespace is not None:
            if fence_dir is None:
                raise InvalidArgument("a namespace session needs a fence directory")
            fence = FenceFile.create(fence_dir, f"{secrets.token_hex(16)}{FENCE_SUFFIX}",
                                     namespace=namespace.name, region_id=namespace.region_id,
                                     num_pages=namespace.geometry.num_pages, handle=handle_of(sid),
                                     owner_uid=owner.uid)
        session = Session(sid, namespace, client, peer, fence, now, now)
        session.owner = owner
        self.sessions[sid] = session
        if self.limits is not None:
            self.limits.session_opened(peer, sid, fence is not None)
        self._owned.setdefault(session.owner.key, {})[sid] = session
        return session

    def get(self, sid: int, peer: bytes) -> Session | None:
        """The live session with this id opened on this connection, lease renewed; else None."""
        session = self.sessions.get(sid)
        if session is None or session.peer != peer:
            return None
        session.last_seen_s = self._clock()
        return session

    def end(self, session: Session, reason: str) -> Zombie | None:
        """End a session: its holds go, its pages stay fenced until its fence is free.

        Returns the zombie, or None when nothing needed fencing (an admin
        session, or a fence already free: then everything is freed now).
        """
        self.sessions.pop(session.id, None)
        if self.limits is not None:
            self.limits.session_ended(session.id)
        self._disown(session.owner.key, session.id)
        if session.namespace is None or session.fence is None:
            return None
        index = session.namespace.index
        fenced = []
        for key, page in session.reservations.items():
            index.abort(key, page, fenced=True)
            fenced.append(page)
        session.reservations.clear()
        zombie = Zombie(session.handle, session.namespace, session.client, session.fence, reason,
                        self._clock(), session.fence.header.created_unix_s, fenced,
                        {page: hold.count for page, hold in session.pins.items()}, session.owner)
        session.pins.clear()
        session.fence.set_state(LOST)
        if (not fenced and not zombie.pins) or session.fence.take_if_free():
            self._release(zombie)  # RELEASED is written under the daemon's exclusive lock
            return None
        self._add_zombie(zombie)
        return zombie

    def evict(self, session: Session) -> tuple[int, int]:
        """Operator's word: end ``session`` and free its pages now, fence or not."""
        zombie = self.end(session, "evicted")
        if zombie is None:
            return 0, 0
        self._drop_zombie(zombie)
        return self._release(zombie)

    def expire(self) -> list[tuple[Session, Zombie | None]]:
        """End every session silent for the lease ttl."""
        deadline = self._clock() - self.lease_ttl_s
        out = []
        for session in [s for s in self.sessions.values() if s.last_seen_s < deadline]:
            out.append((session, self.end(session, "lease expired")))
            self.expired_total += 1
        return out

    # -- zombies --

    def reap_zombies(self) -> list[tuple[Zombie, int, int]]:
        """Free the pages of every zombie whose fence no process of its own holds any more."""
        out = []
        holders: dict | None = None  # /proc/locks, read once per tick and only when needed
        now = self._clock()
        look = now - self._foreign_checked_s >= FOREIGN_CHECK_INTERVAL_S
        for name, zombie in list(self.zombies.items()):
            # taken and kept until the release, so nobody locks in between (take_if_free)
            gone = zombie.fence.take_if_free()
            if not gone and look and zombie.owner is not None and zombie.owner.uid is not None:
                self._foreign_checked_s = now
                if holders is None:
                    holders = lock_holders()
                gone = only_foreign_holders(holders.get(zombie.fence.inode(), []), zombie.owner.uid)
                if gone:
                    log.warning("fence of %s is held only by processes of other users (pids %s): "
                                "not its own, ignored", zombie.describe(),
                                holders.get(zombie.fence.inode()))
            if gone:
                self._drop_zombie(zombie)
                freed, dropped = self._release(zombie)
                self.zombies_released_total += 1
                out.append((zombie, freed, dropped))
        return out

    def release_zombie(self, zombie: Zombie) -> tuple[int, int]:
        self._drop_zombie(zombie)
        return self._release(zombie)

    def _release(self, zombie: Zombie) -> tuple[int, int]:
        if zombie.owner is not None:
            self.note_pins(zombie.owner.key, zombie.namespace.name, [], list(zombie.pins))
        return zombie.release()

    # -- distinct pages pinned per peer (quotas: two sessions of one uid pinning a page hold it once) --

    def note_pins(self, key: object, namespace: str, added: list[int], removed: list[int]) -> None:
        """Pages one session of peer ``key`` began or stopped pinning (its first pin, its last unpin)."""
        counts = self._peer_pins.setdefault((key, namespace), {})
        for page in added:
            counts[page] = counts.get(page, 0) + 1
        for page in removed:
            left = counts.get(page, 0) - 1
            if left > 0:
                counts[page] = left
            else:
                counts.pop(page, None)
        if not counts:
            del self._peer_pins[(key, namespace)]

    def peer_pinned_pages(self, key: object, namespace: str) -> dict[int, int]:
        return self._peer_pins.get((key, namespace), {})

    def pinned_by(self, key: object, namespace: str) -> int:
        """Distinct pages of ``namespace`` that sessions of peer ``key`` (ended ones too) pin."""
        return len(self._peer_pins.get((key, namespace), ()))

    def _add_zombie(self, zombie: Zombie) -> None:
        self.zombies[zombie.fence.name] = zombie
        if zombie.owner is not None:
            self._owned.setdefault(zombie.owner.key, {})[zombie.fence.name] = zombie

    def _drop_zombie(self, zombie: Zombie) -> None:
        del self.zombies[zombie.fence.name]
        if zombie.owner is not None:
            self._disown(zombie.owner.key, zombie.fence.name)

    def _disown(self, key: object, name: object) -> None:
        held = self._owned.get(key)
        if held is not None:
            held.pop(name, None)
            if not held:
                del self._owned[key]

    def owned_by(self, key: object) -> list[Session | Zombie]:
        """Live sessions and fenced ones of one peer (``Peer.key``)."""
        return list(self._owned.get(key, {}).values())

    def find(self, handle: str) -> Session | Zombie | None:
        """The live session or zombie whose handle is ``handle``; InvalidArgument when ambiguous."""
        found: list[Session | Zombie] = [s for s in self.sessions.values() if s.handle == handle]
        found += [z for z in self.zombies.values() if z.handle == handle]
        if len(found) > 1:
            raise InvalidArgument(f"handle {handle} names {len(found)} sessions")
        return found[0] if found else None

    def adopt_fences(self, fence_dir: str, registry: Registry) -> tuple[int, int]:
        """After a restart: fence the pages of every earlier session whose process may live on.

        Returns (zombies adopted, fence files removed). The daemon itself
        sweeps file by file while it serves (``hisparse.daemon.ops.sweep``).
        """
        adopted = removed = 0
        for path in sorted(fence_paths(fence_dir)):
            outcome = self.adopt_fence(path, registry)
            adopted += outcome == "adopted"
            removed += outcome == "removed"
        return adopted, removed

    def adopt_fence(self, path: str, registry: Registry) -> str:
        """One fence file of an earlier run: "adopted", "removed" or "left" (not ours to trust).

        A fence of an unknown namespace or another region holds nothing of
        ours and is removed; one that is not ours to trust is logged and left.
        """
        try:
            fence = FenceFile.adopt(path, owner_uid=os.geteuid())
        except (InvalidArgument, OSError) as exc:
            log.warning("not adopting fence %s: %s; left alone", path, exc)
            return "left"
        ns = registry.namespaces.get(fence.header.namespace)
        if (ns is None or ns.region_id != fence.header.region_id
                or ns.geometry.num_pages != fence.header.num_pages or fence.take_if_free()):
            # (a fence still reading LIVE: released under the exclusive lock, so no worker
            # locks it between the probe and RELEASED and copies into pages freed here)
            fence.close(unlink=True)
            return "removed"
        pages, reserved, pins = fence.held_pages()
        fenced, pinned = ns.index.adopt_fence(pages.tolist(), reserved.tolist(), pins.tolist())
        fence.set_state(LOST)
        uid = fence.header.owner_uid  # recorded at its hello: foreign holders stay harmless
        zombie = Zombie(fence.header.handle, ns, "(from an earlier daemon run)", fence,
                        "daemon restart", self._clock(), fence.header.created_unix_s,
                        fenced, pinned, Peer(uid, None, None) if uid is not None else None)
        self._add_zombie(zombie)
        if zombie.owner is not None:
            self.note_pins(zombie.owner.key, ns.name, list(pinned), [])
        log.info("fenced %d pages and %d pins of %s until its process lets go",
                 len(fenced), sum(pinned.values()), zombie.describe())
        return "adopted"

    def detach_all(self) -> None:
        """Shutdown: leave every fence to the successor (its holders may still be copying)."""
        for session in self.sessions.values():
            if session.fence is not None:
                session.fence.set_state(LOST)
                session.fence.close(unlink=False)
        for zombie in self.zombies.values():
            zombie.fence.close(unlink=False)
        self.sessions.clear()
        self.zombies.clear()
        self._owned.clear()
        self._peer_pins.clear()

    # -- reads --

    def now(self) -> float:
        return self._clock()

    def count_for(self, namespace: Namespace) -> int:
        return sum(1 for s in self.sessions.values() if s.namespace is namespace)

    def all_for(self, namespace: Namespace) -> Iterator[Session]:
        return (s for s in self.sessions.values() if s.namespace is namespace)
