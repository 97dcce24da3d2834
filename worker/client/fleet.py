"""Admin commands to every worker of a subject (messages/control.py): what vLLM's admin routes
do to one server (`/v1/load_lora_adapter`, `/reset_prefix_cache`, `/sleep` …), done to a fleet.

The members are the workers that answer discovery (`$SRV.INFO`) for the subject, in either mode
(core: an endpoint on the subject; JetStream: its work queue), each process of
`--worker-processes` a member of its own. Each member gets the command on its control subject
and answers once; one that does not answer within `timeout` is reported as such, never skipped.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS

from messages.codec import MSGPACK
from messages.control import ControlReply, ControlRequest
from messages.frames import ErrorInfo
from messages.subjects import SERVICE_NAME, Subjects
from worker.client.library import discovery_answers


@dataclass(frozen=True)
class Member:
    """One worker of the subject, as its discovery metadata describes it."""

    instance_id: str
    adapters: dict[str, str] = field(default_factory=dict)
    """The LoRA adapters it holds: name → the path it loaded them from."""


def _member(data: bytes, subjects: Subjects) -> Member | None:
    try:
        info = json.loads(data)
        metadata = info.get("metadata") or {}
        endpoints = info.get("endpoints") or []
    except (ValueError, AttributeError):
        return None
    serves = any(e.get("subject") == subjects.generate for e in endpoints if isinstance(e, dict))
    queued = metadata.get("queue_subject") == subjects.queue
    if not (serves or queued) or "instance_id" not in metadata:
        return None
    try:
        adapters = json.loads(metadata.get("adapters") or "{}")
    except ValueError:
        return None
    if not isinstance(adapters, dict):
        return None
    return Member(metadata["instance_id"], adapters)


async def members(nc: NATS, generate_subject: str, *, window: float = 0.5) -> list[Member]:
    """Every worker of `generate_subject` that answers discovery within `window` seconds."""
    subjects = Subjects.parse(generate_subject)[0]
    found: dict[str, Member] = {}
    async for data in discovery_answers(nc, f"$SRV.INFO.{SERVICE_NAME}", window):
        member = _member(data, subjects)
        if member is not None:
            found[member.instance_id] = member
    return [found[key] for key in sorted(found)]


async def command(
    nc: NATS, subjects: Subjects, instance_id: str, request: ControlRequest, timeout: float
) -> ControlReply:
    """One worker's answer to `request`; no answer in time is a reply with `worker_lost`."""
    try:
        answer = await nc.request(
            subjects.control(instance_id), MSGPACK.encode(request), timeout=timeout
        )
        return MSGPACK.decode_as(answer.data, ControlReply)
    except Exception as error:  # nats-py: timeout, no responders, a reply of another shape
        return ControlReply(
            instance_id=instance_id,
            command=request.command,
            error=ErrorInfo("worker_lost", f"no answer within {timeout} s ({error!r})"),
        )


async def command_all(
    nc: NATS,
    generate_subject: str,
    request: ControlRequest,
    *,
    window: float = 0.5,
    timeout: float = 60.0,
) -> list[ControlReply]:
    """`request` sent to every member at once; their answers, by instance id."""
    subjects = Subjects.parse(generate_subject)[0]
    found = await members(nc, generate_subject, window=window)
    return list(
        await asyncio.gather(
            *(command(nc, subjects, m.instance_id, request, timeout) for m in found)
        )
    )
