"""Subject names: `<namespace>.<component>.<endpoint>` for the queue group,
`<namespace>.<component>.<endpoint>.<instance_id>` for direct routing to one worker, and
`<namespace>.<component>.<endpoint>.cancel` (every worker, no queue group) for cancellation, and
`<namespace>.<component>.kv.<endpoint>.{events,snapshot,load}.<instance_id>` for KV-cache routing
(messages/kv.py), and `<namespace>.<component>.control.<endpoint>.<instance_id>` for one worker's
admin commands (messages/control.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

# One subject token: no dots, spaces or wildcards, or the subject would mean something else.
_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+$")
CANCEL_TOKEN = "cancel"
# The NATS micro service name workers register under: discovery asks `$SRV.<verb>.<name>`.
SERVICE_NAME = "vllm-nats-worker"
# JetStream mode: a queued request's reply subject travels in this header (a JetStream message's
# own reply subject is its ack subject).
REPLY_HEADER = "Reply-To"
# The header that marks a worker's liveness probe on a reply subject (an empty NATS request whose
# "no responders" answer means nobody listens): readers skip such messages; they are not frames.
PROBE_HEADER = "Vllm-Nats-Probe"
KV_KINDS = ("events", "snapshot", "load")
# The endpoint of workers of a pooling model (EmbedRequests, messages/embeddings.py), unless
# the worker is told another.
EMBED_ENDPOINT = "embed"


@dataclass(frozen=True)
class Subjects:
    namespace: str = "llm"
    component: str = "vllm"
    endpoint: str = "generate"

    def __post_init__(self) -> None:
        for name in ("namespace", "component", "endpoint"):
            value = getattr(self, name)
            if not _TOKEN.match(value):
                raise ValueError(f"{name} {value!r} must be one NATS subject token [A-Za-z0-9_-]+")

    @property
    def generate(self) -> str:
        return f"{self.namespace}.{self.component}.{self.endpoint}"

    @property
    def queue(self) -> str:
        """The JetStream work-queue subject (`--mode jetstream`); apart from the core subjects."""
        return f"{self.namespace}.{self.component}.queue.{self.endpoint}"

    @property
    def cancel(self) -> str:
        return f"{self.generate}.{CANCEL_TOKEN}"

    def kv(self, kind: str, instance_id: str = "*") -> str:
        """A KV-routing subject of one instance (`kind`: events, snapshot or load); the default
        `*` is the wildcard a router subscribes to."""
        if kind not in KV_KINDS:
            raise ValueError(f"kind {kind!r} must be one of {KV_KINDS}")
        if instance_id != "*" and not _TOKEN.match(instance_id):
            raise ValueError(f"instance_id {instance_id!r} must be one NATS subject token")
        return f"{self.namespace}.{self.component}.kv.{self.endpoint}.{kind}.{instance_id}"

    def control(self, instance_id: str) -> str:
        """One worker's admin commands (messages/control.py)."""
        if not _TOKEN.match(instance_id):
            raise ValueError(f"instance_id {instance_id!r} must be one NATS subject token")
        return f"{self.namespace}.{self.component}.control.{self.endpoint}.{instance_id}"

    def instance(self, instance_id: str) -> str:
        if not _TOKEN.match(instance_id) or instance_id == CANCEL_TOKEN:
            raise ValueError(
                f"instance_id {instance_id!r} must be one NATS subject token, not {CANCEL_TOKEN!r}"
            )
        return f"{self.generate}.{instance_id}"

    @classmethod
    def parse(cls, subject: str) -> tuple[Subjects, str | None]:
        """A generate subject `namespace.component.endpoint` → (its Subjects, None); an instance
        subject `namespace.component.endpoint.<instance_id>` → (its Subjects, the id). The one
        parser of request subjects; ValueError for anything else."""
        tokens = subject.split(".")
        if len(tokens) not in (3, 4) or (len(tokens) == 4 and tokens[3] == CANCEL_TOKEN):
            raise ValueError(
                f"not a generate subject (namespace.component.endpoint[.instance_id]): {subject!r}"
            )
        subjects = cls(*tokens[:3])
        if len(tokens) == 3:
            return subjects, None
        subjects.instance(tokens[3])  # the same token rule as the instance subjects made here
        return subjects, tokens[3]
