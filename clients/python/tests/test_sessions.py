"""Concurrent sessions never mix: threads, asyncio tasks, and what crosses between them."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Set, Tuple

from mock_provider import MockProvider

from nm_gateway import Gateway, current_session

N = 8
CALLS = 3


def by_session(fake: MockProvider) -> Dict[Optional[str], Set[Optional[str]]]:
    """session id -> the users its requests carried; also checks the count per session."""
    users: Dict[Optional[str], Set[Optional[str]]] = defaultdict(set)
    counts: Dict[Optional[str], int] = defaultdict(int)
    for r in fake.received():
        sid = r.headers.get("nm-session")
        users[sid].add(r.headers.get("nm-user"))
        counts[sid] += 1
    assert all(c == CALLS for c in counts.values()), dict(counts)
    return users


def test_threads_each_with_their_own_session(gw: Gateway, fake: MockProvider) -> None:
    client = gw.openai()  # one client shared by every thread, as an application would
    barrier = threading.Barrier(N)  # all sessions are open at once before anyone sends
    ids: Dict[int, str] = {}

    def worker(i: int) -> None:
        with gw.session(user=f"thread-user-{i}") as s:
            ids[i] = s.id
            barrier.wait(timeout=30)
            for _ in range(CALLS):
                client.chat.completions.create(model="m", messages=[])
                assert current_session() is not None and current_session().id == s.id  # type: ignore[union-attr]
            assert s.last_request_id is not None

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(ids) == N
    users = by_session(fake)
    assert users == {ids[i]: {f"thread-user-{i}"} for i in range(N)}


async def test_tasks_each_with_their_own_session(gw: Gateway, fake: MockProvider) -> None:
    client = gw.async_openai()
    entered = 0
    all_in = asyncio.Event()
    ids: Dict[int, str] = {}

    async def task(i: int) -> None:
        nonlocal entered
        async with gw.session(user=f"task-user-{i}") as s:
            ids[i] = s.id
            entered += 1
            if entered == N:
                all_in.set()
            await all_in.wait()  # every session open before any request
            for _ in range(CALLS):
                await client.chat.completions.create(model="m", messages=[])
                await asyncio.sleep(0)  # let the others interleave
            assert current_session() is not None and current_session().id == s.id  # type: ignore[union-attr]

    await asyncio.gather(*(task(i) for i in range(N)))
    assert current_session() is None
    users = by_session(fake)
    assert users == {ids[i]: {f"task-user-{i}"} for i in range(N)}


#: Python 3.14+: threads start with a copy of the starter's context when this flag is set
#: (`-X thread_inherit_context=1`, the default of free-threaded builds); absent before 3.14.
THREADS_INHERIT = bool(getattr(sys.flags, "thread_inherit_context", False))


def test_a_thread_does_not_inherit_a_session_unless_carried(gw: Gateway, fake: MockProvider) -> None:
    """The README's sentences, one by one: a plain `threading.Thread`, an executor's worker and
    `loop.run_in_executor` start without the session (unless Python's thread_inherit_context
    flag is set); `threading.Thread(target=s.wrap(fn))`, `executor.submit(s.run, fn)` and
    `executor.submit(s.wrap(fn))` carry it. The gateway sees exactly that."""
    client = gw.openai()

    def ask() -> Optional[str]:
        client.chat.completions.create(model="m", messages=[])
        s = current_session()
        return None if s is None else s.id

    got: Dict[str, Optional[str]] = {}

    def into(name: str, fn: Callable[[], Optional[str]]) -> Callable[[], None]:
        def run() -> None:
            got[name] = fn()

        return run

    with gw.session(user="u") as s, ThreadPoolExecutor(2) as pool:
        for target in (into("plain thread", ask), s.wrap(into("wrapped thread", ask))):
            t = threading.Thread(target=target)
            t.start()
            t.join()
        got["executor"] = pool.submit(ask).result()
        got["executor, s.run"] = pool.submit(s.run, ask).result()
        got["executor, s.wrap"] = pool.submit(s.wrap(ask)).result()

        async def in_executor() -> Optional[str]:
            return await asyncio.get_running_loop().run_in_executor(pool, ask)

        got["run_in_executor"] = asyncio.run(in_executor())
    # With the flag, the pool's workers (started in here) have a copy of the session too.
    inherited = s.id if THREADS_INHERIT else None
    want = {
        "plain thread": inherited,
        "wrapped thread": s.id,
        "executor": inherited,
        "executor, s.run": s.id,
        "executor, s.wrap": s.id,
        "run_in_executor": inherited,
    }
    assert got == want
    assert [r.headers.get("nm-session") for r in fake.received()] == list(want.values())


async def test_tasks_and_to_thread_inherit_the_session(gw: Gateway, fake: MockProvider) -> None:
    sync_client = gw.openai()
    async_client = gw.async_openai()
    async with gw.session(user="u") as s:
        task = asyncio.create_task(async_client.chat.completions.create(model="m", messages=[]))
        await task
        await asyncio.to_thread(sync_client.chat.completions.create, model="m", messages=[])
    # A task created outside, running while another task is inside a session, has none.
    await async_client.chat.completions.create(model="m", messages=[])
    got: List[Tuple[Optional[str], Optional[str]]] = [
        (r.headers.get("nm-session"), r.headers.get("nm-user")) for r in fake.received()
    ]
    assert got == [(s.id, "u"), (s.id, "u"), (None, None)]


async def test_a_session_left_by_one_task_stays_in_the_other(gw: Gateway, fake: MockProvider) -> None:
    client = gw.async_openai()
    a_done = asyncio.Event()

    async def a() -> str:
        async with gw.session(user="a") as s:
            await client.chat.completions.create(model="m", messages=[])
        a_done.set()
        return s.id

    async def b() -> str:
        async with gw.session(user="b") as s:
            await a_done.wait()  # a has left its session; b is still inside its own
            await client.chat.completions.create(model="m", messages=[])
            return s.id

    id_a, id_b = await asyncio.gather(a(), b())
    got = [(r.headers.get("nm-session"), r.headers.get("nm-user")) for r in fake.received()]
    assert got == [(id_a, "a"), (id_b, "b")]
