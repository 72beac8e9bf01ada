"""Meeting points in the store: ranks wait for each other outside any collective, and a rank that went on is seen.

A barrier that one rank never calls blocks the others until the timeout (300 s by default), and says only that
a rank did not arrive. A meeting is kept in the process group's store instead: each rank that comes sets its key,
and while it waits for the others it reads the progress board (:mod:`paratrain.diagnostics.board`). A rank that
launched a collective this one has not (its next training step's gradient reduction, say) waits in it for this
rank, and a rank that closed its end of the group has left: neither will come, so the wait ends at once (within a
heartbeat or two) with an error naming them, and what they should have called. A rank that went on otherwise (a
collective of its own, outside paratrain's) is found by the timeout. The strategy's collectives meet before they
launch (each rank posts which it is about to run), and so do zero3's forwards under no_grad and its training
forwards beyond the count the last backward followed.

    meeting = Meeting(store, "paratrain/strategy-0/meet", rank, timeout, gone=monitor.peers_gone)
    meeting.attend("sharded-save", range(n), "par.save()", refuse=lambda gone: f"... {gone} went on ...")
    meeting.announce("save-ab12", "written")                # rank 0 wrote the file; the others wait for its word:
    meeting.attend("save-ab12", [0], "par.save()", refuse=..., come=False)
    meeting.exchange("sharded-write", "written", range(n), "par.save()", refuse=..., sync=par.barrier)  # every word
    meeting.attend("collective", range(n), "par.barrier()", refuse=..., value="barrier", error=CollectiveError)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from paratrain.errors import CollectiveError, ConfigError

__all__ = ["Meeting"]

POLL_S = 0.05  # how often the store is asked whether the others came, at most: the first asks come sooner
FIRST_POLL_S = 0.0005  # (ranks that arrive together, as at every evaluation forward under zero3, wait little)
GONE_EVERY_S = 0.5  # how often the board is read for ranks that went on


class Meeting:
    """Named points every rank of a group can wait at, kept under ``prefix`` in the group's ``store``.

    Args:
        store: the process group's key-value store (``set``/``get``/``check``).
        prefix: the same on every rank, unique to the group (the strategy's namespace).
        rank: this process's global rank.
        timeout: seconds a wait may last when no rank is seen going on (a rank that died, or stopped).
        gone: the global ranks that went on past this point, and how
            (:meth:`paratrain.comm.collectives.CollectiveMonitor.peers_gone`, over every monitor).
    """

    def __init__(
        self, store: object, prefix: str, rank: int, timeout: float, gone: Callable[[], dict[int, str]]
    ) -> None:
        self._store = store
        self._prefix = prefix
        self.rank = rank
        self.timeout = timeout
        self._gone = gone
        self._counts: dict[str, int] = {}
        self._last: dict[str, frozenset[int]] = {}  # the ranks of each name's last meeting that every rank came to
        # meetings whose ranks launch collectives as soon as every rank came (zero3's gathering of the weights), and
        # what a rank waiting there does: one waiting at such a meeting that this rank has not come to went on, for
        # every other meeting, as a rank that launched a collective did
        self.launching: dict[str, str] = {}

    def attend(
        self,
        name: str,
        ranks: Iterable[int],
        what: str,
        refuse: Callable[[dict[int, str]], str],
        *,
        come: bool = True,
        value: str = "here",
        error: Callable[[str], BaseException] = ConfigError,
        overdue: Callable[[list[int]], BaseException] | None = None,
    ) -> dict[int, str]:
        """Come to the next meeting called ``name`` (``come=False``: only wait there), posting ``value``, and wait
        for ``ranks``; what each posted there. A meeting refused or timed out is withdrawn: this rank's next one of
        that name is the same meeting again, so a loop that goes on after the error meets its peers at the next call.

        Raises:
            ConfigError, CollectiveError: as :meth:`wait_for` (``error`` and ``overdue`` as there).
        """
        point = self._next(name)
        ranks = list(ranks)
        if come:
            self.post(point, value)
        try:
            posted = self.wait_for(point, ranks, what, refuse, error=error, overdue=overdue)
        except BaseException:
            self._counts[name] -= 1
            if come:
                self._store.delete_key(self._key(point, self.rank))  # type: ignore[attr-defined]
            raise
        if come:
            self._forget_previous(name, ranks)
        return posted

    def exchange(
        self,
        name: str,
        value: str,
        ranks: Iterable[int],
        what: str,
        refuse: Callable[[dict[int, str]], str],
        *,
        sync: Callable[[], None],
    ) -> dict[int, str]:
        """Post ``value`` at the next meeting called ``name``, call ``sync`` (a barrier every one of ``ranks``
        calls), then read what each of them posted (there already: no waiting). A rank that failed posts its
        failure and still comes, so the others learn of it at once instead of at the timeout; ``sync`` being a
        collective, a peer that died fails it at once too (a wait in the store would only see that at the timeout).

        Raises:
            ConfigError, CollectiveError: as :meth:`wait_for`; and whatever ``sync`` raises.
        """
        point = self._next(name)
        ranks = list(ranks)
        self.post(point, value)
        sync()
        posted = self.wait_for(point, ranks, what, refuse)
        self._forget_previous(name, ranks)
        return posted

    def _waiting_elsewhere(self, ranks: Iterable[int], point: str) -> dict[int, str]:
        """The ranks among ``ranks`` waiting at the next meeting of a :attr:`launching` name other than ``point``'s
        (this rank's next one: it has not come there), and what they do there. Only the key's presence is read: a
        rank may withdraw it at any time, and a read of a key gone would wait for it."""
        found: dict[int, str] = {}
        here = point.rsplit("-", 1)[0]
        for name, doing in self.launching.items():
            if name == here:
                continue
            there = f"{name}-{self._counts.get(name, 0) + 1}"
            for r in ranks:
                if r not in found and self._store.check([self._key(there, r)]):  # type: ignore[attr-defined]
                    found[r] = doing
        return found

    def _forget_previous(self, name: str, ranks: list[int]) -> None:
        """Every one of ``ranks`` came to this meeting, so each has finished waiting at the one before: this rank's
        key there is read by no one any more (when they are the ranks that waited there) and is deleted, so a long
        run's meetings (one per evaluation forward under zero3) keep two keys a rank in the store, not thousands."""
        everyone = frozenset(ranks) | {self.rank}
        before = self._last.get(name)
        if before is not None and before <= everyone and self._counts[name] > 1:
            self._store.delete_key(self._key(f"{name}-{self._counts[name] - 1}", self.rank))  # type: ignore[attr-defined]
        self._last[name] = everyone

    def announce(self, name: str, value: str) -> None:
        """Tell the ranks waiting at the next meeting called ``name`` (``attend(..., come=False)``) ``value``."""
        self.post(self._next(name), value)

    def _next(self, name: str) -> str:
        """``name`` with this rank's count of it: the n-th meeting of that name is the n-th on every rank."""
        self._counts[name] = self._counts.get(name, 0) + 1
        return f"{name}-{self._counts[name]}"

    def _key(self, point: str, rank: int) -> str:
        return f"{self._prefix}/{point}/{rank}"

    def post(self, point: str, value: str = "here") -> None:
        """This rank reached ``point`` (``value``: what it has to tell the others there)."""
        self._store.set(self._key(point, self.rank), value)  # type: ignore[attr-defined]

    def wait_for(
        self,
        point: str,
        ranks: Iterable[int],
        what: str,
        refuse: Callable[[dict[int, str]], str],
        *,
        error: Callable[[str], BaseException] = ConfigError,
        overdue: Callable[[list[int]], BaseException] | None = None,
    ) -> dict[int, str]:
        """Wait until every one of ``ranks`` posted ``point``; what each posted. ``what``: the call, for errors.

        Raises:
            ConfigError: a rank still missing went on past the point (``refuse`` makes the message from the
                ranks that did, and how; ``error`` the exception from the message).
            CollectiveError: a rank still missing neither came nor went on within the timeout (``overdue``, given
                the ranks still missing, makes the exception instead).
        """
        missing = [r for r in ranks if r != self.rank]
        posted: dict[int, str] = {}
        started = time.monotonic()
        looked = started
        pause = FIRST_POLL_S
        while missing:
            for r in list(missing):
                key = self._key(point, r)
                if self._store.check([key]):  # type: ignore[attr-defined]
                    posted[r] = self._store.get(key).decode()  # type: ignore[attr-defined]
                    missing.remove(r)
            if not missing:
                break
            now = time.monotonic()
            if now - looked >= GONE_EVERY_S:
                looked = now
                gone = {r: how for r, how in self._gone().items() if r in missing}
                gone.update(self._waiting_elsewhere(missing, point))
                # a rank seen gone may have come just before: its key there settles it
                gone = {r: how for r, how in gone.items() if not self._store.check([self._key(point, r)])}  # type: ignore[attr-defined]
                if gone:
                    raise error(refuse(gone))
            if now - started > self.timeout:
                if overdue is not None:
                    raise overdue(missing)
                raise CollectiveError(
                    f"rank {self.rank} waited {self.timeout:g} s for rank(s) {', '.join(map(str, missing))} at "
                    f"{what}, which neither came nor launched a collective since (stopped, or dead?)"
                )
            time.sleep(pause)
            pause = min(POLL_S, pause * 2)
        return posted
