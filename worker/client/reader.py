"""Reading one request's frames: `seq` order, one stop rule, folding into a Completion.

The one frame reader of the project (the library, the frontend and the tests use it). It stops
at the request's end: every choice finished, or one error frame. Messages that carry the
liveness-probe header are the worker's probes and are skipped.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol

import nats.errors
from msgspec import UNSET, UnsetType
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from messages.codec import Codec
from messages.frames import ResponseFrame, TopLogprob, Usage
from messages.subjects import PROBE_HEADER


class FrameOrderError(RuntimeError):
    """A frame arrived out of `seq` order, or one is missing."""


class RequestError(RuntimeError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class WorkerLost(RequestError):
    """Nothing (no frame, no heartbeat) came from the worker serving the request for the
    client's silence timeout: the worker is taken for dead."""

    def __init__(self, message: str) -> None:
        super().__init__("worker_lost", message)


def is_probe(msg: Msg) -> bool:
    """A worker's liveness probe on a reply subject (marked by a header), not a frame."""
    return msg.headers is not None and PROBE_HEADER in msg.headers


class RequestEnd:
    """The one stop rule: a request has ended once every one of its `choices` sent a frame with
    a finish reason, or at its (single) error frame."""

    def __init__(self, choices: int) -> None:
        self.choices = choices
        self.finished: set[int] = set()
        self.ended = False

    def saw(self, index: int, finish_reason: str | None) -> bool:
        """Records one frame's (index, finish_reason); True once the request has ended."""
        if finish_reason == "error":
            self.ended = True
        elif finish_reason is not None:
            self.finished.add(index)
            self.ended = len(self.finished) >= self.choices
        return self.ended

    def restart(self) -> None:
        """A new delivery attempt (JetStream) starts the request over."""
        self.finished.clear()
        self.ended = False


class FrameOrder:
    """The `seq` order of one request's frames (0, 1, 2, …; a gap or a reordering is a
    FrameOrderError). With `attempts` (JetStream), a frame of a newer delivery attempt restarts
    the count and late frames of an older attempt are skipped."""

    def __init__(self, attempts: bool) -> None:
        self.attempts = attempts
        self.attempt = 0
        self.expected = 0
        self.restarted = False
        """Whether the frame last taken began a newer attempt."""

    def take(self, seq: int, attempt: int | None | UnsetType) -> bool:
        """False for a late frame of an older attempt (skip it)."""
        self.restarted = False
        if self.attempts:
            frame_attempt = attempt or 0
            if frame_attempt < self.attempt:
                return False
            if frame_attempt > self.attempt:
                self.attempt, self.expected, self.restarted = frame_attempt, 0, True
        if seq != self.expected:
            where = f"attempt {self.attempt}: " if self.attempts else ""
            raise FrameOrderError(f"{where}expected seq {self.expected}, got {seq}")
        self.expected += 1
        return True


class MessageSource(Protocol):
    """What frames are read from: an Inbox, or a plain nats-py Subscription."""

    async def next_msg(self, timeout: float) -> Msg: ...


class Inbox:
    """A reply subscription whose messages are read without a task per message.

    nats-py's `Subscription.next_msg` makes a uuid, a task and (before Python 3.12) a second
    task inside `wait_for` for every message; a reader of a token-per-frame stream pays that per
    token, a large share of a frontend process's time under load (bench.frame_reader sets the
    two readers side by side). Here nats-py hands each message to a callback (public API) that
    queues it and wakes the one waiting reader; the timeout is a timer handle, not a task.
    """

    def __init__(self) -> None:
        self._messages: deque[Msg] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.subscription: Subscription | None = None

    @classmethod
    async def open(cls, nc: NATS, subject: str) -> Inbox:
        inbox = cls()
        inbox.subscription = await nc.subscribe(subject, cb=inbox._deliver)
        return inbox

    async def _deliver(self, msg: Msg) -> None:
        self._messages.append(msg)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next_msg(self, timeout: float) -> Msg:
        """The next message; nats' TimeoutError when none came within `timeout` seconds."""
        if not self._messages:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(timeout, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        return self._messages.popleft()

    async def unsubscribe(self) -> None:
        if self.subscription is not None:
            await self.subscription.unsubscribe()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(nats.errors.TimeoutError())


def no_responders(msg: Msg) -> str | None:
    """The subject nobody subscribes to, when `msg` is NATS's "no responders" status (503, empty
    body) for a request published with this reply subject; else None."""
    headers = msg.headers
    if msg.data or headers is None or headers.get("Status") != "503":
        return None
    return headers.get("Nats-Subject", "the request's subject")


async def frame_payloads(
    subscription: MessageSource,
    timeout: float,
    silence: float | None = None,
    *,
    quiet_until_heard: bool = False,
) -> AsyncGenerator[bytes, None]:
    """The encoded frames arriving on a reply subscription, probes and heartbeats skipped.

    `timeout`: the longest wait for any message (nats' TimeoutError past it). `silence`: the
    longest wait for any message once the worker was heard from, WorkerLost past it (workers
    send heartbeats: worker/nats/liveness.py); `quiet_until_heard`: before the first message
    only `timeout` applies (a JetStream request may wait in its stream for a worker). NATS's
    "no responders" ends it at once as `no_workers`."""
    heard = not quiet_until_heard
    while True:
        lost_after = silence if silence is not None and heard and silence < timeout else None
        try:
            msg = await subscription.next_msg(timeout=lost_after or timeout)
        except nats.errors.TimeoutError:
            if lost_after is None:
                raise
            raise WorkerLost(
                f"nothing from the worker for {lost_after:g} s (no frame, no heartbeat)"
            ) from None
        heard = True
        if is_probe(msg):
            continue
        if not msg.data:
            if (subject := no_responders(msg)) is not None:
                raise RequestError(
                    "no_workers", f"no worker listens on {subject} (NATS: no responders)"
                )
            raise RequestError("internal_error", "an empty message that is not a probe or frame")
        yield msg.data


async def read_frames(
    subscription: MessageSource,
    codec: Codec,
    end: RequestEnd,
    timeout: float,
    *,
    attempts: bool = False,
    silence: float | None = None,
) -> AsyncGenerator[ResponseFrame, None]:
    """Frames in `seq` order until the request ends (`end`, the one stop rule).

    `attempts` (JetStream): a frame of a newer delivery attempt restarts the count at seq 0; late
    frames of an older attempt are skipped. `end.ended` is set before the last frame is yielded,
    so a caller that stops at that frame does not cancel a request that is over. `silence`: see
    `frame_payloads` (with `attempts`, counted from the first message, as the request may wait
    in its stream).
    """
    order = FrameOrder(attempts)
    payloads = frame_payloads(subscription, timeout, silence, quiet_until_heard=attempts)
    async for data in payloads:
        frame = codec.decode_frame(data)
        if not order.take(frame.seq, frame.attempt):
            continue
        if order.restarted:
            end.restart()
        ended = end.saw(frame.index, frame.finish_reason)
        yield frame
        if ended:
            return


@dataclass
class Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[TopLogprob]] = field(default_factory=list)
    finish_reason: str | None = None
    # The matched stop string or stop token id when finish_reason is "stop".
    stop_reason: str | int | None = None
    usage: Usage | None = None


@dataclass
class Completion:
    """All frames of a request folded together (what a non-streaming caller wants)."""

    request_id: str
    frames: list[ResponseFrame]
    choices: list[Choice]
    prompt_log_probs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[TopLogprob] | None] = field(default_factory=list)
    error: RequestError | None = None


def fold(request_id: str, frames: list[ResponseFrame], choices: int) -> Completion:
    result = Completion(request_id, frames, [Choice(i) for i in range(choices)])
    for frame in frames:
        if frame.error:
            result.error = RequestError(frame.error.code, frame.error.message)
        if frame.prompt_log_probs:
            if frame.prompt_position != len(result.prompt_log_probs):
                raise FrameOrderError("prompt logprob frames out of position order")
            result.prompt_log_probs += frame.prompt_log_probs
            result.prompt_top_logprobs += frame.prompt_top_logprobs or []
        if frame.finish_reason == "error":
            continue
        choice = result.choices[frame.index]
        choice.token_ids += frame.token_ids
        if frame.log_probs:
            choice.log_probs += frame.log_probs
        if frame.top_logprobs:
            choice.top_logprobs += frame.top_logprobs
        if frame.finish_reason is not None:
            choice.finish_reason = frame.finish_reason
            choice.stop_reason = None if frame.stop_reason is UNSET else frame.stop_reason
            choice.usage = frame.completion_usage or None
    return result
