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
    """One worker, as its discovery metadata describes it."""

    instance_id: str
    adapters: dict[str, str] = field(default_factory=dict)
    """The LoRA adapters it holds: name → the path it loaded them from."""
    subject: str = ""
    """The subject of its model's requests (`namespace.component.endpoint`)."""
    jetstream: bool = False
    """It takes them from the subject's work queue (`--mode jetstream`)."""
    model: str = ""
    """Its served model name."""
    kind: str = "generate"
    """What it serves: "generate", or "embed" (a pooling model)."""
    tokenizer: str = ""
    """Where its model's tokenizer is (a path or hub name)."""
    max_model_len: int | None = None


def _member(data: bytes) -> Member | None:
    """The Member an INFO answer describes; None for any other answer or a malformed one."""
    try:
        info = json.loads(data)
        metadata = info.get("metadata") or {}
        endpoints = info.get("endpoints") or []
        adapters = json.loads(metadata.get("adapters") or "{}")
        instance_id = metadata["instance_id"]
        queue = metadata.get("queue_subject")
        subject = metadata.get("subject") or _served_subject(endpoints, queue)
        length = metadata.get("max_model_len")
        max_model_len = int(length) if length else None
    except (ValueError, AttributeError, KeyError, TypeError):
        return None
    if not isinstance(adapters, dict) or not subject:
        return None
    return Member(
        instance_id,
        adapters,
        subject,
        queue is not None,
        str(metadata.get("model", "")),
        str(metadata.get("kind", "generate")),
        str(metadata.get("tokenizer", "")),
        max_model_len,
    )


def _served_subject(endpoints: list[dict[str, str]], queue: str | None) -> str:
    """The model subject of a worker whose metadata does not name it (an older worker): its
    `generate` endpoint's, or its work queue's (`ns.comp.queue.endpoint` → `ns.comp.endpoint`)."""
    for endpoint in endpoints:
        if endpoint.get("name") == "generate":
            return endpoint.get("subject", "")
    if queue:
        namespace, component, _, name = queue.split(".")
        return f"{namespace}.{component}.{name}"
    return ""


async def everyone(nc: NATS, *, window: float = 0.5) -> list[Member]:
    """Every worker that answers discovery within `window` seconds, of every subject."""
    found: dict[str, Member] = {}
    async for data in discovery_answers(nc, f"$SRV.INFO.{SERVICE_NAME}", window):
        member = _member(data)
        if member is not None:
            found[member.instance_id] = member
    return [found[key] for key in sorted(found)]


async def members(nc: NATS, generate_subject: str, *, window: float = 0.5) -> list[Member]:
    """Every worker of `generate_subject` that answers discovery within `window` seconds."""
    return [m for m in await everyone(nc, window=window) if m.subject == generate_subject]


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
