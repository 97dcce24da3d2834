"""Continuing a request on another worker when the one serving it is lost (migration).

A request's stream is served in legs. When a leg's worker goes silent (worker.client.reader
`WorkerLost`: no frame and no heartbeat for the silence timeout), or ends the leg with a
retryable error frame that is not a refusal (`worker_shutdown` when a drain timed out,
`engine_error`, `internal_error`), the next leg is a *continuation*: the original prompt plus
every token the caller already received, the `max_tokens` and `min_tokens` that remain, and the
same sampling, stop and logprob options. The caller sees one stream (`Seam.translate`):
- `seq` goes on from the last frame it received; `attempt` stays that of the first leg;
- usage counts the original prompt and every generated token (not the continuation's prompt);
- prompt logprob rows already received are not sent again (a continuation asks for them only
  when some are missing, and positions past the original prompt are dropped);
- a greedy request continues token for token as the undisturbed run (the continuation's prompt
  is exactly what that run had in its context), with the same logprobs within float noise;
- a seeded request continues with `seed + K` (K tokens received): reproducible given where the
  seam fell, but not the undisturbed run's sample, since vLLM's per-request generator cannot be
  fast-forwarded to position K.

Not continued (the error reaches the caller as before): a request with `n > 1` (each choice would
need a prompt of its own) and one with `guided_decoding` (the constraint would start over on the
continuation's output). Stop strings still match across the seam: a continuation says how many
of its prompt tokens are earlier output (`continued_tokens`), and the worker finds a stop string
that began there (worker/engine/seam_stops.py), since vLLM matches only its own output text.
"""

from __future__ import annotations

import time

import msgspec
from msgspec import UNSET

from messages.frames import ResponseFrame, Usage
from messages.request import INT64_MIN, GenerateRequest

MIGRATION_LIMIT = 3
"""Continuations per request. A request whose legs lost three workers in a row is more likely
killing them than unlucky: a limit keeps one poisonous request from taking down a fleet."""
SILENCE_TIMEOUT_S = 5.0
"""Seconds without any message (a live worker's heartbeats come at least every 1.5 s) before
the worker serving a request is taken for dead; a loaded host's event-loop lag stays well under."""


class Seam:
    """What the caller received of one request, across its legs."""

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.tokens: list[int] = []
        self.prompt_rows = 0
        """Prompt logprob rows the caller received (positions 0 … prompt_rows - 1)."""
        self.seq = 0
        self.attempt: int | msgspec.UnsetType = UNSET
        self.legs = 1
        self._started = time.monotonic()

    @property
    def prompt_len(self) -> int:
        return len(self.request.token_ids)

    def why_not_continued(self) -> str | None:
        """Why this request cannot be continued on another worker; None when it can."""
        if self.request.sampling_options.n != 1:
            return "n > 1 (each choice would need a prompt of its own)"
        if self.request.sampling_options.guided_decoding is not None:
            return "guided_decoding (the constraint would start over)"
        return None

    def translate(self, frame: ResponseFrame) -> ResponseFrame | None:
        """The frame as the caller's one stream has it, or None when it holds nothing new."""
        if self.legs == 1:  # the first leg's frames are the caller's as they are
            if self.seq == 0:
                self.attempt = frame.attempt
            if frame.prompt_log_probs is not UNSET and frame.prompt_position is not UNSET:
                self.prompt_rows = frame.prompt_position + len(frame.prompt_log_probs)
            self.tokens += frame.token_ids
            self.seq += 1
            return frame
        frame = self._trim_prompt_rows(frame)
        if (
            not frame.token_ids
            and frame.finish_reason is None
            and frame.prompt_log_probs is UNSET
            and frame.error is UNSET
        ):
            return None
        self.tokens += frame.token_ids
        frame.seq, frame.attempt = self.seq, self.attempt
        self.seq += 1
        if frame.completion_usage is not UNSET:
            frame.completion_usage = self.usage()
        return frame

    def usage(self) -> Usage:
        completion = len(self.tokens)
        return Usage(self.prompt_len, completion, self.prompt_len + completion)

    def _trim_prompt_rows(self, frame: ResponseFrame) -> ResponseFrame:
        """Keeps the prompt rows the caller has not received: positions from `prompt_rows` to
        the end of the original prompt (a continuation's later positions are output tokens)."""
        rows, start = frame.prompt_log_probs, frame.prompt_position
        if rows is UNSET or start is UNSET:
            return frame
        keep_from = max(start, self.prompt_rows)
        keep_to = min(start + len(rows), self.prompt_len)
        if keep_from >= keep_to:
            frame.prompt_log_probs = frame.prompt_top_logprobs = frame.prompt_position = UNSET
            return frame
        frame.prompt_log_probs = rows[keep_from - start : keep_to - start]
        if frame.prompt_top_logprobs is not UNSET:
            frame.prompt_top_logprobs = frame.prompt_top_logprobs[
                keep_from - start : keep_to - start
            ]
        frame.prompt_position = keep_from
        self.prompt_rows = keep_to
        return frame

    def continuation(self) -> GenerateRequest | None:
        """The next leg's request; None when no token is left to generate (`final_frame`)."""
        request, done = self.request, len(self.tokens)
        stop = request.stop_conditions
        max_tokens = None if stop.max_tokens is None else stop.max_tokens - done
        if max_tokens is not None and max_tokens <= 0:
            return None
        sampling = request.sampling_options
        seed = sampling.seed
        if seed is not None:
            seed = (seed + done - INT64_MIN) % 2**64 + INT64_MIN  # wrapped into int64
        min_tokens = None if stop.min_tokens is None else max(0, stop.min_tokens - done) or None
        output = request.output_options
        prompt_logprobs = output.prompt_logprobs if self.prompt_rows < self.prompt_len else None
        timeout_ms = request.timeout_ms
        if timeout_ms is not None:
            elapsed_ms = int((time.monotonic() - self._started) * 1000)
            timeout_ms = max(1, timeout_ms - elapsed_ms)
        self.legs += 1
        return msgspec.structs.replace(
            request,
            token_ids=[*request.token_ids, *self.tokens],
            sampling_options=msgspec.structs.replace(sampling, seed=seed),
            stop_conditions=msgspec.structs.replace(
                stop, max_tokens=max_tokens, min_tokens=min_tokens
            ),
            output_options=msgspec.structs.replace(output, prompt_logprobs=prompt_logprobs),
            timeout_ms=timeout_ms,
            continued_tokens=(request.continued_tokens or 0) + done,
        )

    def final_frame(self) -> ResponseFrame:
        """The end of a request whose every token was received before its final frame was."""
        frame = ResponseFrame(
            request_id=self.request.request_id,
            seq=self.seq,
            attempt=self.attempt,
            finish_reason="length",
            completion_usage=self.usage(),
        )
        self.seq += 1
        return frame
