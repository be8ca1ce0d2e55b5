"""The tasks serving one tab as one structured unit: none outlives the tab, none fails unseen, and none survives a
cancel that was swallowed.

``asyncio.TaskGroup``'s idea, on Python 3.10 too, plus one rule it lacks. On Python 3.10 and 3.11
``asyncio.wait_for`` returns the awaited result when it is ready in the same step as a cancel arrives, and the
cancel is lost (the client's ``next_chunk`` and ``error`` wait that way). A pump cancelled there runs on, and
whoever waits for it waits forever: a closed tab's session stayed open for good. So a task is stopped in two ways
at once: it is marked unwanted, then cancelled; every loop here asks ``wanted()`` after each wait, so a cancel that
was swallowed still ends it at its next turn.

    tasks = TabTasks()
    tasks.spawn(sender())
    failure = await tasks.run(reader())  # until the reader returns or any task fails; then every task is stopped
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class TabTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._unwanted: set[asyncio.Task[Any]] = set()
        self._failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self.stopping = False

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Start ``work`` as one of the tab's tasks (refused once the tab is stopping)."""
        if self.stopping:
            work.close()
            raise RuntimeError("the tab is over: no new task")
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def wanted(self) -> bool:
        """Whether the calling task should go on (``False`` once it was stopped, even if its cancel was lost)."""
        return not self.stopping and asyncio.current_task() not in self._unwanted

    async def run(self, body: Coroutine[Any, Any, Any]) -> BaseException | None:
        """Run ``body`` as a task until it returns or any task fails, then stop every task; the failure, if any.
        Cancelled itself (the gateway stopping), it stops every task all the same."""
        main = self.spawn(body)
        try:
            await asyncio.wait({main, self._failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.stopping = True
            await self._stop(set(self._tasks))
        return self._failed.result() if self._failed.done() else None

    async def stop(self, task: asyncio.Task[Any]) -> None:
        """Stop one task (e.g. a session's pump) and wait until it is done."""
        await self._stop({task})

    async def _stop(self, tasks: set[asyncio.Task[Any]]) -> None:
        self._unwanted |= tasks
        for task in tasks:
            task.cancel()
        if tasks:
            # asyncio.wait, not `await task`: it neither raises the task's cancel here nor swallows one of ours
            await asyncio.wait(tasks)
        self._unwanted -= tasks

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task in self._unwanted:
            return
        failure = task.exception()
        if failure is not None and not self._failed.done():
            self._failed.set_result(failure)
