"""One request's life: engine steps → frames, final frames per choice, errors as frames.

Invariants the session owns:
- prompt logprob frames (if asked) come before the first generated token's frame;
- each choice ends with exactly one frame whose finish_reason is set, carrying completion_usage;
- an error ends the request with exactly one frame (finish_reason "error", `error` set), after which
  nothing more is sent for any choice: clients stop on it;
- when the session's task is interrupted, the engine request is aborted (the engine stream is
  closed, and vLLM aborts a request whose stream closes) and the client gets either the
  interrupt's error frame (drain, dead engine) or, for a cancel, a final frame with
  finish_reason "cancelled" for each open choice (with the reason in `error` for a deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from messages.errors import ErrorCode, is_retryable, kind
from messages.frames import ErrorInfo, ResponseFrame, Usage
from messages.request import GenerateRequest
from worker.engine.contract import Engine, EngineDead, EngineFailure
from worker.errors import WorkerError, describe
from worker.framing import FrameWriter, Undeliverable
from worker.metrics import WorkerMetrics
from worker.shared.log_text import loggable

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What happened to one request: for the log line, metrics and service stats."""

    request_id: str
    finish_reasons: list[str | None]
    completion_tokens: int = 0
    error_code: ErrorCode | None = None
    error_message: str = ""
    first_token_s: float | None = None
    started: float = field(default_factory=time.monotonic)
    requeue: bool = False
    """The request failed retryably and another attempt will run it (JetStream): no frame sent."""

    @property
    def outcomes(self) -> list[str]:
        """What the request ended with, for metrics: its error code alone, else each choice's
        finish reason (one per choice)."""
        if self.error_code is not None:
            return [self.error_code]
        return [str(reason) for reason in self.finish_reasons]

    @property
    def label(self) -> str:
        """The outcomes in one word, for the request's log line (e.g. `length,stop`)."""
        return ",".join(self.outcomes)


async def send_error(
    writer: FrameWriter, request_id: str, code: ErrorCode, message: str, index: int = 0
) -> None:
    await writer.send(
        ResponseFrame(
            request_id=request_id,
            seq=0,
            index=index,
            finish_reason="error",
            error=ErrorInfo(code=code, message=message or kind(code).meaning),
        )
    )


async def fail(
    outcome: Outcome, writer: FrameWriter, code: ErrorCode, message: str, *, final_attempt: bool
) -> None:
    """Ends a request with its error: recorded in `outcome`, and its one error frame sent,
    unless the error is retryable and the intake delivers the request again (nothing is sent:
    the next attempt answers). A frame that cannot be sent is logged, never raised."""
    outcome.error_code = code
    outcome.error_message = message
    if is_retryable(code) and not final_attempt:
        outcome.requeue = True
        return
    try:
        await send_error(writer, outcome.request_id, code, message)
    except Undeliverable as error:
        log.warning(
            "request %s: error frame not sent: %s", loggable(outcome.request_id), loggable(error)
        )
    except Exception:
        log.exception("could not send the error frame of %s", loggable(outcome.request_id))


class RequestSession:
    def __init__(
        self,
        request: GenerateRequest,
        engine: Engine,
        writer: FrameWriter,
        engine_request_id: str,
        metrics: WorkerMetrics | None = None,
        final_attempt: bool = True,
        *,
        arrived: float | None = None,
    ) -> None:
        """`arrived`: time.monotonic() when the request's message was taken from NATS (what
        time to first token counts from); default now."""
        self.request = request
        # False while the intake can still retry the request by delivering it again (JetStream
        # with attempts left): retryable failures then end silently (the next attempt answers)
        # instead of with an error frame.
        self.final_attempt = final_attempt
        self.engine = engine
        self.writer = writer
        self.engine_request_id = engine_request_id
        self.metrics = metrics
        n = request.sampling_options.n
        self.outcome = Outcome(request.request_id, [None] * n)
        if arrived is not None:
            self.outcome.started = arrived
        self._generated = [0] * n
        self._last_token_at: list[float | None] = [None] * n
        # (cancel?, reason code, message) of an interrupt; None while not interrupted.
        self._interrupt: tuple[bool, ErrorCode | None, str] | None = None

    def interrupt(self, task: asyncio.Task[object], code: ErrorCode, message: str) -> None:
        """Ends the session early (its task is cancelled); the client gets this error frame."""
        if self._interrupt is None:
            self._interrupt = (False, code, message)
            task.cancel()

    def cancel(
        self, task: asyncio.Task[object], reason: ErrorCode | None = None, message: str = ""
    ) -> None:
        """Ends the session early with finish_reason "cancelled" on every open choice."""
        if self._interrupt is None:
            self._interrupt = (True, reason, message)
            task.cancel()

    async def run(self) -> Outcome:
        """Serves the request to its end. Re-raises EngineDead after answering the client."""
        if self.metrics is not None:
            self.metrics.admitted(time.monotonic() - self.outcome.started)
        try:
            await self._stream()
            open_choices = [i for i, r in enumerate(self.outcome.finish_reasons) if r is None]
            if open_choices:
                raise EngineFailure(f"engine stream ended with choices {open_choices} unfinished")
        except asyncio.CancelledError:
            if self._interrupt is None:
                raise
            is_cancel, code, message = self._interrupt
            if is_cancel:
                await self._send_cancelled(code, message)
            else:
                await self._fail(code or "internal_error", message)
        except Undeliverable as error:
            # Nothing can reach the client, an error frame included: record why, send nothing.
            log.warning("request %s: %s", loggable(self.request.request_id), loggable(error))
            self.outcome.error_code = error.code
            self.outcome.error_message = str(error)
        except EngineDead as error:
            await self._fail(error.code, str(error))
            raise
        except WorkerError as error:
            await self._fail(error.code, str(error))
        except Exception as error:  # a bug must not leave the client waiting
            log.exception("request %s failed", loggable(self.request.request_id))
            await self._fail("internal_error", describe(error))
        finally:
            self.outcome.completion_tokens = sum(self._generated)
        return self.outcome

    async def _stream(self) -> None:
        request = self.request
        request_id = request.request_id
        prompt_tokens = len(request.token_ids)
        want_logprobs = request.output_options.logprobs is not None
        send = self.writer.send
        # aclosing: leaving the loop (cancel, error) closes the engine stream at once, which
        # aborts the request in the engine, instead of whenever the generator is collected.
        steps = contextlib.aclosing(self.engine.generate(request, self.engine_request_id))
        async with steps as stream:
            async for step in stream:
                if step.prompt is not None:
                    await send(
                        ResponseFrame(
                            request_id=request_id,
                            seq=0,
                            prompt_position=0,
                            prompt_log_probs=step.prompt.log_probs,
                            prompt_top_logprobs=step.prompt.top_logprobs,
                        )
                    )
                for choice in step.choices:
                    if choice.token_ids:
                        self._count_tokens(choice.index, len(choice.token_ids))
                    frame = ResponseFrame(
                        request_id=request_id, seq=0, index=choice.index, token_ids=choice.token_ids
                    )
                    if want_logprobs:
                        frame.log_probs = choice.log_probs or []
                        frame.top_logprobs = choice.top_logprobs or []  # type: ignore[assignment]
                    if choice.finish_reason is not None:
                        generated = self._generated[choice.index]
                        frame.finish_reason = choice.finish_reason
                        if choice.stop_reason is not None:
                            frame.stop_reason = choice.stop_reason
                        frame.completion_usage = Usage(
                            prompt_tokens, generated, prompt_tokens + generated
                        )
                        if choice.finish_reason == "error":
                            frame.error = ErrorInfo("engine_error", "the engine ended this choice")
                        self.outcome.finish_reasons[choice.index] = choice.finish_reason
                    await send(frame)

    async def _send_cancelled(self, reason: ErrorCode | None, message: str) -> None:
        prompt_tokens = len(self.request.token_ids)
        for index, finish in enumerate(self.outcome.finish_reasons):
            if finish is not None:
                continue
            generated = self._generated[index]
            frame = ResponseFrame(
                request_id=self.request.request_id,
                seq=0,
                index=index,
                finish_reason="cancelled",
                completion_usage=Usage(prompt_tokens, generated, prompt_tokens + generated),
            )
            if reason is not None:
                frame.error = ErrorInfo(reason, message)
            self.outcome.finish_reasons[index] = "cancelled"
            try:
                await self.writer.send(frame)
            except Undeliverable as error:
                log.warning(
                    "request %s: cancel frame not sent: %s",
                    loggable(self.request.request_id),
                    loggable(error),
                )
                return
            except Exception:
                log.exception(
                    "could not send the cancel frame of %s", loggable(self.request.request_id)
                )

    def _count_tokens(self, index: int, count: int) -> None:
        now = time.monotonic()
        self._generated[index] += count
        if self.outcome.first_token_s is None:
            self.outcome.first_token_s = now - self.outcome.started
            if self.metrics is not None:
                self.metrics.first_token(self.outcome.first_token_s)
        last = self._last_token_at[index]
        self._last_token_at[index] = now
        if self.metrics is not None:
            self.metrics.tokens(count, None if last is None else now - last)

    async def _fail(self, code: ErrorCode, message: str) -> None:
        await fail(self.outcome, self.writer, code, message, final_attempt=self.final_attempt)
