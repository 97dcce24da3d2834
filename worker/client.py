"""The publisher side: send a GenerateRequest over NATS and read its frames.

Needs only nats-py and `messages` (no vllm or torch). It subscribes to its own inbox before
publishing (so no frame can be missed), checks `seq` order, enforces a per-frame timeout, and
stops at the request's end: every choice finished, or one error frame. A caller that stops
iterating early (break, cancellation, an exception) cancels the request on the workers, so the
engine is freed at once. Empty messages are the worker's liveness probes and are skipped.

A retryable refusal (`overloaded`, `worker_shutdown`) that comes before anything was yielded is
retried on another worker: `discover_workers` asks the workers' NATS micro STATS which instances
serve the subject and how busy they are, and the next attempt goes to the least busy one with
free capacity on its instance subject, never to one that already refused. A draining worker has
stopped its micro service, so it is not discovered at all.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from messages.codec import JSON, MSGPACK, Codec
from messages.errors import is_refusal
from messages.frames import ErrorInfo, ResponseFrame, TopLogprob, Usage
from messages.request import CancelRequest, GenerateRequest
from messages.subjects import CANCEL_TOKEN, SERVICE_NAME, Subjects


class FrameOrderError(RuntimeError):
    """A frame arrived out of `seq` order, or one is missing."""


class RequestError(RuntimeError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def micro_error(msg: Msg) -> RequestError | None:
    """The error of a NATS micro error reply (empty body, `Nats-Service-Error*` headers), which
    a responder gives when its handler raised; None for anything else, e.g. a liveness probe."""
    if msg.data or not msg.headers or "Nats-Service-Error-Code" not in msg.headers:
        return None
    code = msg.headers["Nats-Service-Error-Code"]
    return RequestError(
        "internal_error", f"micro error {code}: {msg.headers.get('Nats-Service-Error', '')}"
    )


@dataclass
class _ReadState:
    ended: bool = False
    """True once the request's last frame was read (so leaving early needs no cancel)."""


async def _read_frames(
    subscription: Subscription,
    codec: Codec,
    choices: int,
    timeout: float,
    state: _ReadState,
    *,
    attempts: bool = False,
) -> AsyncIterator[ResponseFrame]:
    """The one reader loop: frames in `seq` order until every choice finished or an error frame.

    `attempts` (JetStream): a frame of a newer delivery attempt restarts the count at seq 0; late
    frames of an older attempt are skipped. `state.ended` is set before the last frame is
    yielded, so a caller that stops at that frame does not cancel a request that is over.
    """
    attempt = 0
    expected_seq = 0
    finished: set[int] = set()
    while True:
        msg = await subscription.next_msg(timeout=timeout)
        if not msg.data:
            if (error := micro_error(msg)) is not None:
                raise error
            continue  # the worker's liveness probe
        frame = codec.decode_frame(msg.data)
        if attempts:
            frame_attempt = frame.attempt or 0
            if frame_attempt < attempt:
                continue
            if frame_attempt > attempt:
                attempt, expected_seq = frame_attempt, 0
                finished.clear()
        if frame.seq != expected_seq:
            where = f"attempt {attempt}: " if attempts else ""
            raise FrameOrderError(f"{where}expected seq {expected_seq}, got {frame.seq}")
        expected_seq += 1
        if frame.finish_reason == "error":
            state.ended = True
        elif frame.finish_reason is not None:
            finished.add(frame.index)
            state.ended = len(finished) >= choices
        yield frame
        if state.ended:
            return


async def _publish_cancel(nc: NATS, cancel_subject: str, request_id: str, inbox: str) -> None:
    """Cancels the request of this id whose frames go to `inbox`: only the publisher knows its
    inbox, so a request of another publisher with the same id is not touched."""
    cancel = CancelRequest(request_id=request_id, reply_subject=inbox)
    try:
        await nc.publish(cancel_subject, MSGPACK.encode(cancel))
    except Exception:  # connection gone: the worker's liveness probe notices instead
        pass


async def stream_frames(
    nc: NATS,
    subject: str,
    payload: bytes,
    *,
    codec: Codec = MSGPACK,
    choices: int = 1,
    timeout: float = 60.0,
    request_id: str | None = None,
    cancel_subject: str | None = None,
) -> AsyncIterator[ResponseFrame]:
    """Frames of one request, in order, until all `choices` finished or an error frame.

    With `request_id` and `cancel_subject`, leaving early publishes a cancel for the request.
    """
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    headers = {"Content-Type": codec.content_type} if codec is JSON else None
    state = _ReadState()
    try:
        await nc.publish(subject, payload, reply=inbox, headers=headers)
        async with aclosing(_read_frames(subscription, codec, choices, timeout, state)) as frames:
            async for frame in frames:
                yield frame
    finally:
        if not state.ended and request_id is not None and cancel_subject is not None:
            await _publish_cancel(nc, cancel_subject, request_id, inbox)
        await subscription.unsubscribe()


@dataclass
class Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[TopLogprob]] = field(default_factory=list)
    finish_reason: str | None = None
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
            choice.usage = frame.completion_usage or None
    return result


@dataclass(frozen=True)
class WorkerInstance:
    """One worker as its micro STATS describe it."""

    instance_id: str
    subject: str
    """Its instance subject (`<generate subject>.<instance_id>`)."""
    in_flight: int
    max_concurrency: int | None

    @property
    def has_capacity(self) -> bool:
        return self.max_concurrency is None or self.in_flight < self.max_concurrency


async def discover_workers(
    nc: NATS, generate_subject: str, *, window: float = 0.25, name: str = SERVICE_NAME
) -> list[WorkerInstance]:
    """Workers that serve `generate_subject`, from every answer to `$SRV.STATS.<name>` that
    arrives within `window` seconds (micro services answer a discovery request each)."""
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    found: list[WorkerInstance] = []
    try:
        await nc.publish(f"$SRV.STATS.{name}", b"", reply=inbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + window
        while (left := deadline - loop.time()) > 0:
            try:
                msg = await subscription.next_msg(timeout=left)
            except Exception:  # nats TimeoutError: the window is over
                break
            instance = _instance_from_stats(msg.data, generate_subject)
            if instance is not None:
                found.append(instance)
    finally:
        await subscription.unsubscribe()
    return found


def _instance_from_stats(data: bytes, generate_subject: str) -> WorkerInstance | None:
    try:
        stats = json.loads(data)
        endpoints = stats.get("endpoints") or []
        subjects = {e.get("subject"): e for e in endpoints}
        if generate_subject not in subjects:
            return None  # a worker of other subjects (or JetStream mode: no core endpoints)
        instance_id = stats["metadata"]["instance_id"]
        limit = stats["metadata"].get("max_concurrency", "unlimited")
        in_flight = int((subjects[generate_subject].get("data") or {}).get("in_flight", 0))
        return WorkerInstance(
            instance_id,
            f"{generate_subject}.{instance_id}",
            in_flight,
            None if limit == "unlimited" else int(limit),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _split_subject(subject: str) -> tuple[str, str | None]:
    """`a.b.c` → (`a.b.c`, None); the instance subject `a.b.c.<id>` → (`a.b.c`, `<id>`)."""
    tokens = subject.split(".")
    if len(tokens) == 4:
        return ".".join(tokens[:3]), tokens[3]
    return subject, None


async def generate(
    nc: NATS,
    request: GenerateRequest,
    *,
    subject: str | None = None,
    codec: Codec = MSGPACK,
    timeout: float = 60.0,
    retries: int = 2,
    discovery_window: float = 0.25,
) -> AsyncIterator[ResponseFrame]:
    """`async for frame in generate(nc, request)`: the request's frames as they stream.

    `subject` is the generate subject (or an instance subject under it); cancels go to the
    cancel subject of the same namespace/component/endpoint. A retryable refusal that comes
    before any frame was yielded is retried up to `retries` times on other workers (see the
    module's docstring); when none is left, RequestError names the code and every refusal.
    Any other error frame, and a retryable one after output began, is yielded as it came.
    """
    subject = subject or Subjects().generate
    base, instance_id = _split_subject(subject)
    refused: set[str] = set()
    refusals: list[str] = []
    last: ErrorInfo | None = None
    target = subject
    # Every target is the queue group or an instance subject under it: one cancel subject.
    cancel_subject = cancel_subject_for(subject)
    for attempt in range(retries + 1):
        yielded = False
        refusal: ErrorInfo | None = None
        async with aclosing(
            stream_frames(
                nc,
                target,
                codec.encode(request),
                codec=codec,
                choices=request.sampling_options.n,
                timeout=timeout,
                request_id=request.request_id,
                cancel_subject=cancel_subject,
            )
        ) as frames:
            async for frame in frames:
                if not yielded and frame.error and is_refusal(frame.error.code):
                    refusal = frame.error
                    break
                yielded = True
                yield frame
        if refusal is None:
            return
        last = refusal
        refusals.append(f"{instance_id or 'queue group ' + base}: {refusal.message}")
        if instance_id is not None:
            refused.add(instance_id)
        if attempt == retries:
            break
        candidates = [
            worker
            for worker in await discover_workers(nc, base, window=discovery_window)
            if worker.instance_id not in refused and worker.has_capacity
        ]
        if not candidates:
            refusals.append("no other worker with free capacity")
            break
        chosen = min(candidates, key=lambda worker: worker.in_flight)
        target, instance_id = chosen.subject, chosen.instance_id
    assert last is not None
    raise RequestError(last.code, f"refused after {attempt + 1} attempt(s): " + "; ".join(refusals))


def cancel_subject_for(subject: str) -> str:
    """`a.b.c` or the instance subject `a.b.c.<id>` → `a.b.c.cancel`."""
    tokens = subject.split(".")
    return Subjects(*tokens[:3]).cancel if len(tokens) >= 3 else f"{subject}.{CANCEL_TOKEN}"


async def complete(
    nc: NATS,
    request: GenerateRequest,
    *,
    subject: str | None = None,
    codec: Codec = MSGPACK,
    timeout: float = 60.0,
    retries: int = 2,
) -> Completion:
    frames = [
        f
        async for f in generate(
            nc, request, subject=subject, codec=codec, timeout=timeout, retries=retries
        )
    ]
    return fold(request.request_id, frames, request.sampling_options.n)


REPLY_HEADER = "Reply-To"


async def jetstream_generate(
    nc: NATS,
    request: GenerateRequest,
    *,
    subjects: Subjects | None = None,
    codec: Codec = MSGPACK,
    timeout: float = 60.0,
) -> AsyncIterator[ResponseFrame]:
    """Publishes to the work-queue stream (`--mode jetstream`) with a JetStream ack, then yields
    the frames. Frames carry `attempt`: when a worker died and the request was redelivered, a
    new attempt's frames restart at seq 0 and the caller drops what the old attempt sent (late
    frames of an older attempt are skipped here)."""
    subjects = subjects or Subjects()
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    headers = {REPLY_HEADER: inbox}
    if codec is JSON:
        headers["Content-Type"] = codec.content_type
    state = _ReadState()
    try:
        await nc.jetstream().publish(subjects.queue, codec.encode(request), headers=headers)
        reader = _read_frames(
            subscription, codec, request.sampling_options.n, timeout, state, attempts=True
        )
        async with aclosing(reader) as frames:
            async for frame in frames:
                yield frame
    finally:
        if not state.ended:
            await _publish_cancel(nc, subjects.cancel, request.request_id, inbox)
        await subscription.unsubscribe()


async def jetstream_complete(
    nc: NATS,
    request: GenerateRequest,
    *,
    subjects: Subjects | None = None,
    codec: Codec = MSGPACK,
    timeout: float = 60.0,
) -> tuple[Completion, list[int]]:
    """The last attempt's answer, folded; and the attempts whose frames were seen, in order."""
    frames: list[ResponseFrame] = []
    attempts: list[int] = []
    async for frame in jetstream_generate(
        nc, request, subjects=subjects, codec=codec, timeout=timeout
    ):
        if not attempts or frame.attempt != attempts[-1]:
            attempts.append(frame.attempt or 0)
            frames = []  # a new attempt replaces the partial output of the one before
        frames.append(frame)
    return fold(request.request_id, frames, request.sampling_options.n), attempts


async def wait_for_worker(nc: NATS, timeout: float, name: str = SERVICE_NAME) -> bool:
    """True once a worker answers `$SRV.PING.<name>` (workers register as NATS micro services)."""
    import time

    import nats.errors

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            await nc.request(f"$SRV.PING.{name}", b"", timeout=1.0)
            return True
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            await asyncio.sleep(0.5)
    return False


def _parse_args(argv: list[str] | None):  # -> argparse.Namespace
    import argparse
    import os

    parser = argparse.ArgumentParser(
        prog="python -m worker.client",
        description="Send one generation request over NATS and print its tokens with logprobs.",
    )
    parser.add_argument("--nats-url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--subject", default=Subjects().generate)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--token-ids", help="comma-separated prompt token ids")
    prompt.add_argument("--prompt", help="prompt text (needs --tokenizer)")
    parser.add_argument("--tokenizer", help="tokenizer directory for --prompt (transformers)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--logprobs", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="send and receive JSON, not msgpack")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait per frame")
    parser.add_argument(
        "--retries",
        type=int,
        default=2,
        help="retries of an overloaded/worker_shutdown refusal on other workers",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        help="first wait up to this many seconds for a worker to answer $SRV.PING",
    )
    args = parser.parse_args(argv)
    if args.prompt is not None and not args.tokenizer:
        parser.error("--prompt needs --tokenizer")
    return args


async def _main(argv: list[str] | None) -> int:
    import uuid

    import nats

    from messages.request import OutputOptions, SamplingOptions, StopConditions

    args = _parse_args(argv)
    if args.token_ids is not None:
        token_ids = [int(t) for t in args.token_ids.split(",") if t.strip()]
    else:
        from transformers import AutoTokenizer

        token_ids = AutoTokenizer.from_pretrained(args.tokenizer)(args.prompt).input_ids
    request = GenerateRequest(
        request_id=f"cli-{uuid.uuid4().hex[:8]}",
        token_ids=token_ids,
        sampling_options=SamplingOptions(temperature=args.temperature),
        stop_conditions=StopConditions(max_tokens=args.max_tokens),
        output_options=OutputOptions(logprobs=args.logprobs),
    )
    nc = await nats.connect(args.nats_url)
    try:
        if args.wait > 0 and not await wait_for_worker(nc, args.wait):
            print(f"no worker answered $SRV.PING within {args.wait}s")
            return 1
        frames = generate(
            nc,
            request,
            subject=args.subject,
            codec=JSON if args.json else MSGPACK,
            timeout=args.timeout,
            retries=args.retries,
        )
        async for frame in _report_refusal(frames):
            rows = frame.top_logprobs or [[] for _ in frame.token_ids]
            values = frame.log_probs or [None] * len(frame.token_ids)
            for token_id, logprob, row in zip(frame.token_ids, values, rows, strict=True):
                chosen = next((e for e in row if e.token_id == token_id), None)
                text = repr(chosen.token) if chosen else ""
                alternatives = "  ".join(f"{e.token!r}:{e.logprob:.3f}" for e in row)
                print(f"{frame.index}:{token_id:>6} {text:<18} {logprob!s:>22}  {alternatives}")
            if frame.error:
                print(f"error {frame.error.code}: {frame.error.message}")
                return 1
            if frame.finish_reason is not None:
                print(
                    f"{frame.index}: finish_reason={frame.finish_reason} {frame.completion_usage}"
                )
        return 0
    finally:
        await nc.close()


async def _report_refusal(frames: AsyncIterator[ResponseFrame]) -> AsyncIterator[ResponseFrame]:
    """The frames; a refusal that outlasted every retry becomes one last error frame."""
    try:
        async for frame in frames:
            yield frame
    except RequestError as error:
        yield ResponseFrame(
            request_id="", seq=-1, finish_reason="error", error=ErrorInfo(error.code, error.message)
        )


def main(argv: list[str] | None = None) -> None:
    import asyncio
    import sys

    sys.exit(asyncio.run(_main(argv)))


if __name__ == "__main__":
    main()
