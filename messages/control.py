"""The fleet's control plane: one worker's admin commands, as vLLM's admin routes name them.

A command is a NATS request to one worker on `Subjects.control(instance_id)` (its instance id
from discovery); the worker answers with one `ControlReply`. A frontend that acts on a model
sends the command to every worker of the model and reports each answer (worker/client/fleet.py).
Field names are those of vLLM's request bodies: `lora_name`, `lora_path`, `load_inplace`
(`/v1/load_lora_adapter`), `level` (`/sleep`), `tags` (`/wake_up`).
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

import msgspec

from messages.frames import ErrorInfo

ControlCommand = Literal[
    "load_lora_adapter",
    "unload_lora_adapter",
    "list_lora_adapters",
    "reset_prefix_cache",
    "sleep",
    "wake_up",
    "is_sleeping",
]
CONTROL_COMMANDS: tuple[str, ...] = get_args(ControlCommand)
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class ControlRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    command: ControlCommand
    lora_name: Name | None = None
    # A directory on the worker's host (vLLM loads adapters from local paths).
    lora_path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] | None = None
    load_inplace: bool = False
    # vLLM's sleep levels: 1 offloads the weights and drops the KV cache, 2 drops both.
    level: Annotated[int, msgspec.Meta(ge=1, le=2)] = 1
    tags: list[Name] | None = None


class ControlReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One worker's answer. `error` set: the command failed on this worker (its code says
    why: invalid_request, model_not_found, engine_error). Otherwise the command's result, and
    always the adapters the worker holds afterwards (name → path)."""

    instance_id: str
    command: str
    error: ErrorInfo | None = None
    adapters: dict[str, str] = msgspec.field(default_factory=dict)
    is_sleeping: bool | None = None
    # reset_prefix_cache: False when the engine could not (running requests hold blocks).
    reset: bool | None = None
