"""Steps for an idle engine: vLLM's EngineCore steps only while its scheduler has requests or
a connector has "push work"; an idle one blocks on its input queue and runs no step at all.
The scheduler's connector has two reasons to step while idle: holds that end (their blocks go
back, `holds.py`) and its copy of what the decode nodes announced, which only a step's
report renews (`held_mirror.py`). It tells vLLM through `has_pending_push_work`; `IdleWaker`
breaks the idle engine's wait at those moments with the WAKEUP request vLLM itself uses to
wake an idle engine for shutdown.

Such a step must not keep a core busy: vLLM's worker processes (its multiprocessing executor)
take each step's input from a shared-memory queue and, after a read, poll it without sleeping
for a second (vLLM's `busy_loop_s`) before they wait on its notify socket. Measured here: an
idle decode node holding turns (a step a second) and an idle prefill node renewing its copy
(five a second) each kept its worker's core 98-100% busy. After a step that computed nothing
and left nothing in flight, `WorkerSpin.rest` ends that second at once: the worker waits on
the socket, which vLLM's writer notifies with every message, so the next step wakes it.
Only vLLM's multiprocessing executor has such workers (a CPU server always; on a GPU, TP > 1
by default); with `VLLM_USE_SPINLOOP_EXT` a read still polls up to 0.1 s.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from vllm.logger import init_logger

from kvduplex.connector import vllm_private

# Under vLLM's logger tree, so vLLM's handler, format and level apply.
logger = init_logger(f"vllm.{__name__}")

# After a wake-up the engine steps (and moves the next step's time on) within milliseconds.
_AFTER_WAKEUP_S = 0.05


class IdleWaker:
    """Wakes the idle EngineCore when `next_step_in()` (seconds; <= 0: now, None: no step is
    due) comes. Needs the engine's input queue (`vllm_private.engine_wakeup`); without one
    (an engine stepped by its caller, e.g. `LLM`) what an idle step would do waits for the
    next step, as it does in vLLM."""

    def __init__(self, next_step_in: Callable[[], float | None]) -> None:
        self._next_step_in = next_step_in
        self._changed = threading.Condition()
        self._stop = False
        self._waits_for_nothing = False
        self._put = vllm_private.engine_wakeup()
        if self._put is None:
            logger.info(
                "DuplexConnector found no EngineCoreProc input queue to wake: holds that end "
                "while this engine is idle are freed at its next step"
            )
            return
        threading.Thread(target=self._run, name="kvduplex-idle-waker", daemon=True).start()

    def poke(self) -> None:
        """The next step may be due sooner than when the waker last asked."""
        with self._changed:
            self._changed.notify_all()

    def nudge(self) -> None:
        """A step may be due where none was: wakes the waker only if it waits for nothing
        (cheap enough to call every step)."""
        with self._changed:  # (taken while the waker asks, released once it waits)
            if self._waits_for_nothing:
                self._changed.notify_all()

    def close(self) -> None:
        self._stop = True
        self.poke()

    def _run(self) -> None:
        with self._changed:  # a poke between asking and waiting is not lost
            while not self._stop:
                delay = self._next_step_in()
                if delay is not None and delay <= 0:
                    self._put()
                    delay = _AFTER_WAKEUP_S  # never spin
                self._waits_for_nothing = delay is None
                self._changed.wait(delay)
                self._waits_for_nothing = False


class WorkerSpin:
    """A worker process's read of vLLM's step queue, to end its busy polling after an idle
    step (`vllm_private.worker_rest`). Built by the connector's worker, at start-up. Without
    such a queue (another executor, or a vLLM whose queue has no such poll) `rest` does
    nothing."""

    def __init__(self) -> None:
        self._rest = vllm_private.worker_rest()

    def rest(self) -> None:
        """The worker waits for the next step without polling (vLLM's own idle state)."""
        if self._rest is not None:
            self._rest()
