"""One embedding request's life: the engine's vectors → EmbedResult frames, errors as frames.

The same invariants as a generation (worker/session.py), for a request that answers once:
- it ends with exactly one frame whose `finish_reason` is set: "stop" on the (last) result
  frame, with `usage`, or "error" on the one error frame;
- an interrupt (drain, dead engine) ends it with its error frame, a cancel with the cancel's
  reason (`deadline_exceeded`, or `client_gone` for the client's own cancel); the engine's
  requests are aborted (its task is cancelled inside the engine call);
- a retryable failure on a work queue with attempts left sends nothing (the next attempt
  answers).
"""

from __future__ import annotations

import asyncio
import logging
import time

from messages.embeddings import EmbedRequest, EmbedResult, EmbedUsage
from messages.errors import ErrorCode
from worker.engine.contract import Embedder, EngineDead
from worker.errors import WorkerError, describe
from worker.framing import FrameWriter, Undeliverable
from worker.session import Outcome, fail
from worker.shared.log_text import loggable

log = logging.getLogger(__name__)


class EmbedSession:
    def __init__(
        self,
        request: EmbedRequest,
        embedder: Embedder,
        writer: FrameWriter,
        engine_request_id: str,
        final_attempt: bool = True,
        *,
        arrived: float | None = None,
    ) -> None:
        self.request = request
        self.embedder = embedder
        self.writer = writer
        self.engine_request_id = engine_request_id
        self.final_attempt = final_attempt
        self.outcome = Outcome(request.request_id, [None])
        if arrived is not None:
            self.outcome.started = arrived
        self._interrupt: tuple[ErrorCode, str] | None = None

    def interrupt(self, task: asyncio.Task[object], code: ErrorCode, message: str) -> None:
        if self._interrupt is None:
            self._interrupt = (code, message)
            task.cancel()

    def cancel(
        self, task: asyncio.Task[object], reason: ErrorCode | None = None, message: str = ""
    ) -> None:
        self.interrupt(task, reason or "client_gone", message or "cancelled by its client")

    async def run(self) -> Outcome:
        """Serves the request to its end. Re-raises EngineDead after answering the client."""
        request = self.request
        try:
            vectors = await self.embedder.embed(request, self.engine_request_id)
            self.outcome.first_token_s = time.monotonic() - self.outcome.started
            prompt_tokens = sum(len(tokens) for tokens in request.inputs)
            await self.writer.send(
                EmbedResult(
                    request_id=request.request_id,
                    seq=0,
                    embeddings=vectors,
                    dimensions=len(vectors[0]) // 4 if vectors else 0,
                    finish_reason="stop",
                    usage=EmbedUsage(prompt_tokens, prompt_tokens),
                )
            )
            self.outcome.finish_reasons = ["stop"]
        except asyncio.CancelledError:
            if self._interrupt is None:
                raise
            await self._fail(*self._interrupt)
        except Undeliverable as error:
            log.warning("request %s: %s", loggable(request.request_id), loggable(error))
            self.outcome.error_code = error.code
            self.outcome.error_message = str(error)
        except EngineDead as error:
            await self._fail(error.code, str(error))
            raise
        except WorkerError as error:
            await self._fail(error.code, str(error))
        except Exception as error:  # a bug must not leave the client waiting
            log.exception("request %s failed", loggable(request.request_id))
            await self._fail("internal_error", describe(error))
        return self.outcome

    async def _fail(self, code: ErrorCode, message: str) -> None:
        await fail(self.outcome, self.writer, code, message, final_attempt=self.final_attempt)
