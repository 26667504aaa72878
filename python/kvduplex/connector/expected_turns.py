"""The decode node's turns in flight: requests it will hold as turns when they finish.

A client sends its next turn as soon as it has the answer, and the prefill node's lookup can
reach the decode node before the decode node has taken the finished turn's hold: its engine
takes it one step after the request finishes, and a turn that ends on a stop string is
finished by an abort that vLLM's frontend sends only once the client has its answer. So the
scheduler tells TP rank 0's transfer core, from a request's first step, each turn it may hold
(`md.ExpectedTurn`, by its prompt's end: the fingerprint of all the prompt's tokens), and
settles it when the request finishes (held in the same step's metadata, or not held). Until
then a lookup that says it continues that very prompt (the prefill node handed it off:
`held_mirror.py`) is told to ask again, until its deadline, rather than "none held". A prompt
that merely shares blocks with a turn in flight (a common system prompt) never waits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvduplex.connector import metadata as md
from kvduplex.connector.params import takes_over, unsupported_reason
from kvduplex.connector.token_fingerprint import PromptFingerprints, prompt_fingerprints

if TYPE_CHECKING:
    from vllm.v1.request import Request


class ExpectedTurns:
    """The scheduler's side: what to tell TP rank 0 each step (`take`)."""

    def __init__(self, bidirectional: bool, block_size: int) -> None:
        self._bidirectional = bidirectional
        self._block_size = block_size
        self._expected: set[str] = set()
        self._new: list[md.ExpectedTurn] = []
        self._settled: list[str] = []

    def started(self, request: Request) -> PromptFingerprints | None:
        """A new request: expected when this engine may hold its turn. Returns the prompt's
        fingerprints where they were computed."""
        if (
            not self._bidirectional
            or not takes_over(request.kv_transfer_params)
            or not request.num_prompt_tokens
            or unsupported_reason(request) is not None
        ):
            return None
        prompt = prompt_fingerprints(request, self._block_size)
        self._expected.add(request.request_id)
        self._new.append(md.ExpectedTurn(request.request_id, prompt.end))
        return prompt

    def finished(self, request_id: str) -> None:
        """The request finished; its hold, if any, goes with the same step's metadata."""
        if request_id in self._expected:
            self._expected.remove(request_id)
            self._settled.append(request_id)

    def take(self) -> tuple[list[md.ExpectedTurn], list[str]]:
        """What the step being built tells TP rank 0: turns now expected, turns settled."""
        taken = self._new, self._settled
        self._new, self._settled = [], []
        return taken
