"""The single writer: gathers requests for ``group_window_ms``, makes their events durable in one commit, merges
them into their users' online lists in one write, then answers every request of the group.

One thread does all of it, so two events of one user (in one request or two at once) can never race: the second
merge reads the list the first wrote. A request is acknowledged only when its events are durable (the commit)
and visible (the online write). When the online write fails (the store is down or restarting), the events stay
durable and their users stay *pending*: the requests are answered "not visible" (503: a retry is safe, the log
drops the repeat), and the pending users are merged again every ``retry_online_s`` until the store is back.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from features.recent_events import EVENT_COLUMNS
from serving.events.log import CONFLICT, NEW, EventLog
from serving.events.validate import Event

log = logging.getLogger(__name__)
Push = Callable[[pd.DataFrame, dict[int, int]], object]  # (long-form events, as-of µs per user) -> written


@dataclass
class Outcome:
    status: list[str]  # per event: new | duplicate | conflict
    visible: bool  # every event's user list is online


@dataclass
class _Request:
    events: list[Event]
    quarantined: list[tuple[str, str, str]]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


def long_form(events: list[Event]) -> pd.DataFrame:
    return pd.DataFrame([[getattr(e, c) for c in EVENT_COLUMNS] for e in events], columns=list(EVENT_COLUMNS))


class Writer:
    def __init__(self, event_log: EventLog, push: Push, window_s: float, max_events: int, retry_s: float):
        self.log, self.push = event_log, push
        self.window_s, self.max_events, self.retry_s = window_s, max_events, retry_s
        self.queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self.pending: dict[int, list[Event]] = {}  # user -> durable events not yet in its online list
        self._online_ids: list[int] = []  # event ids written online, to flag in the next commit
        self.counts = {"online_writes": 0, "online_failures": 0, "groups": 0}
        self.online_ok = True
        self.visible_lag_s: list[float] = []  # commit -> visible, last groups (for /metrics)
        self._thread = threading.Thread(target=self._run, name="events-writer", daemon=True)

    def start(self) -> None:
        for event in self.log.not_online():  # durable before a crash or a store outage: merge again
            self.pending.setdefault(event.user_id, []).append(event)
        if self.pending:
            log.info("events: %d user(s) with events not yet online; merging them", len(self.pending))
            self._flush(set(self.pending))
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(
        self, events: list[Event], quarantined: list[tuple[str, str, str]]
    ) -> concurrent.futures.Future:
        request = _Request(events, quarantined)
        self.queue.put(request)
        return request.future

    def stop(self, timeout: float = 10.0) -> None:
        self.queue.put(None)
        self._thread.join(timeout)
        self.log.mark_online(self._online_ids)

    def _gather(self) -> list[_Request] | None:
        try:
            first = self.queue.get(timeout=self.retry_s if self.pending else None)
        except queue.Empty:
            return []
        if first is None:
            return None
        group, n = [first], len(first.events)
        deadline = time.monotonic() + self.window_s
        while n < self.max_events:
            left = deadline - time.monotonic()
            try:
                item = self.queue.get(timeout=left) if left > 0 else self.queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self.queue.put(None)  # stop after this group
                break
            group.append(item)
            n += len(item.events)
        return group

    def _run(self) -> None:
        while True:
            group = self._gather()
            if group is None:
                return
            if not group:  # idle with pending users: try the store again
                self._flush(set(self.pending))
                continue
            try:
                self._write(group)
            except Exception as err:  # noqa: BLE001  the log itself failed: nothing of the group is acknowledged
                log.exception("events: the durable log failed")
                for request in group:
                    request.future.set_exception(err)

    def _write(self, group: list[_Request]) -> None:
        events = [e for r in group for e in r.events]
        quarantined = [q for r in group for q in r.quarantined]
        flagged, self._online_ids = self._online_ids, []
        status = self.log.append(events, quarantined, flagged)
        self.counts["groups"] += 1
        touched = set()
        for event, s in zip(events, status, strict=True):
            if s == NEW:
                self.pending.setdefault(event.user_id, []).append(event)
            if s != CONFLICT:
                touched.add(event.user_id)
        self._flush({u for u in touched if u in self.pending})
        i = 0
        for request in group:
            mine = status[i : i + len(request.events)]
            users = {e.user_id for e, s in zip(request.events, mine, strict=True) if s != CONFLICT}
            i += len(request.events)
            request.future.set_result(Outcome(mine, visible=not (users & self.pending.keys())))

    def _flush(self, users: set[int]) -> None:
        """Merge the pending events of ``users`` into the online store in one write."""
        if not users:
            return
        events = [e for u in users for e in self.pending[u]]
        now_us = time.time_ns() // 1000
        as_of = {}
        for e in events:
            as_of[e.user_id] = max(as_of.get(e.user_id, now_us), e.ts_us)
        t0 = time.monotonic()
        try:
            self.push(long_form(events), as_of)
        except Exception as err:  # noqa: BLE001  store down / restarting: stay pending, answer 503, retry
            self.counts["online_failures"] += 1
            if self.online_ok:
                log.warning("events: the online store refused a write (%s: %s); retrying every %.1fs",
                            type(err).__name__, err, self.retry_s)  # fmt: skip
            self.online_ok = False
            return
        if not self.online_ok:
            log.info("events: the online store is back; %d pending user(s) written", len(users))
        self.online_ok = True
        self.counts["online_writes"] += 1
        self.visible_lag_s = [*self.visible_lag_s[-999:], time.monotonic() - t0]
        for u in users:
            del self.pending[u]
        self._online_ids.extend(e.event_id for e in events)
