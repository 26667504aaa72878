"""Steps for an idle engine: vLLM's EngineCore steps only while its scheduler has requests or
a connector has "push work"; an idle one blocks on its input queue and runs no step at all.
The scheduler's connector has two reasons to step while idle: holds that end (their blocks go
back, `retention.py`) and its copy of what the decode nodes announced, which only a step's
report renews (`held_mirror.py`). It tells vLLM through `has_pending_push_work`; `IdleWaker`
breaks the idle engine's wait at those moments with the WAKEUP request vLLM itself uses to
wake an idle engine for shutdown.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from vllm.logger import init_logger

# Under vLLM's logger tree, so vLLM's handler, format and level apply.
logger = init_logger(f"vllm.{__name__}")

# After a wake-up the engine steps (and moves the next step's time on) within milliseconds.
_AFTER_WAKEUP_S = 0.05


class IdleWaker:
    """Wakes the idle EngineCore when `next_step_in()` (seconds; <= 0: now, None: no step is
    due) comes. Needs the engine's input queue, found on the stack of the EngineCoreProc that
    builds the scheduler; without one (an engine stepped by its caller, e.g. `LLM`) what an
    idle step would do waits for the next step, as it does in vLLM."""

    def __init__(self, next_step_in: Callable[[], float | None]) -> None:
        self._next_step_in = next_step_in
        self._changed = threading.Condition()
        self._stop = False
        self._put = _engine_wakeup()
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
                self._changed.wait(delay)


def _engine_wakeup() -> Callable[[], None] | None:
    """vLLM's way to wake its idle EngineCoreProc: a WAKEUP request on its input queue. The
    connector is built inside `EngineCoreProc.__init__`, whose `self` is on the stack."""
    try:
        from vllm.v1.engine import EngineCoreRequestType
        from vllm.v1.engine.core import EngineCoreProc
    except ImportError:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, EngineCoreProc) and hasattr(owner, "input_queue"):
            queue = owner.input_queue
            return lambda: queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
        frame = frame.f_back
    return None
