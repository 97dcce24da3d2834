"""The worker's control plane (worker/nats/control.py) without a server: each admin command on
an in-memory admin, its one reply by the wire's names, a bad payload answered `invalid_request`,
and a sleeping worker refusing new requests retryably (real engine: tests/e2e/test_cli_worker.py,
tests/e2e/test_admin_routes.py)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from messages.codec import JSON_CONTENT_TYPE, MSGPACK
from messages.control import ControlRequest
from messages.subjects import Subjects
from tests.unit.test_request_service import delivery, refused, served, service_on
from worker.client.requests import make_request
from worker.dev.fakes import FakeAdmin, ScriptedFakeEngine
from worker.nats.control import Control

pytestmark = pytest.mark.unit


class _Published:
    """Stands in for the NATS connection: what the control plane publishes."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.messages.append((subject, data))


class _Msg:
    def __init__(self, data: bytes, headers: dict[str, str] | None = None) -> None:
        self.data = data
        self.headers = headers
        self.reply = "_INBOX.control"


def control_on(admin: FakeAdmin | None) -> tuple[Control, list[dict[str, str]], Any]:
    engine = ScriptedFakeEngine()
    engine.admin = admin
    service = service_on(engine)
    seen: list[dict[str, str]] = []
    nc = _Published()
    control = Control(nc, "unit.vllm.control.generate.w1", "w1", service, seen.append)  # type: ignore[arg-type]
    return control, seen, nc


async def wire_reply(control: Control, fields: dict[str, Any]) -> dict[str, Any]:
    await control.run(ControlRequest(**fields))  # the typed path
    await control._on_message(_Msg(msgspec.msgpack.encode(fields)))  # type: ignore[arg-type]
    _, data = control.nc.messages[-1]  # type: ignore[attr-defined]
    return msgspec.msgpack.decode(data)


def test_the_control_subject_is_one_per_instance() -> None:
    assert Subjects("ns", "vllm", "generate").control("w-1") == "ns.vllm.control.generate.w-1"
    with pytest.raises(ValueError, match="one NATS subject token"):
        Subjects().control("a.b")


async def test_adapters_load_list_and_unload_with_vllms_refusals() -> None:
    admin = FakeAdmin()
    control, seen, _ = control_on(admin)
    load = {"command": "load_lora_adapter", "lora_name": "a", "lora_path": "/adapters/a"}
    reply = await control.run(ControlRequest(**load))
    assert reply.error is None and reply.adapters == {"a": "/adapters/a"}
    assert seen == [{"a": "/adapters/a"}]  # discovery learns it at once
    again = await control.run(ControlRequest(**load))
    assert again.error is not None and again.error.code == "invalid_request"
    assert "has already been loaded" in again.error.message
    listed = await control.run(ControlRequest(command="list_lora_adapters"))
    assert listed.error is None and listed.adapters == {"a": "/adapters/a"}
    unload = ControlRequest(command="unload_lora_adapter", lora_name="a")
    assert (await control.run(unload)).adapters == {}
    missing = await control.run(unload)
    assert missing.error is not None and missing.error.code == "model_not_found"
    assert missing.error.message == "The lora adapter 'a' cannot be found."
    no_path = await control.run(ControlRequest(command="load_lora_adapter", lora_name="b"))
    assert no_path.error is not None and no_path.error.message == "lora_path: required"


async def test_a_reply_speaks_the_requests_wire_names() -> None:
    control, _, nc = control_on(FakeAdmin())
    reply = await wire_reply(control, {"command": "reset_prefix_cache"})
    assert reply == {"instance_id": "w1", "command": "reset_prefix_cache", "reset": True}
    json_msg = _Msg(b'{"command": "is_sleeping"}', {"Content-Type": JSON_CONTENT_TYPE})
    await control._on_message(json_msg)  # type: ignore[arg-type]
    subject, data = nc.messages[-1]
    assert subject == "_INBOX.control"
    assert msgspec.json.decode(data) == {
        "instance_id": "w1",
        "command": "is_sleeping",
        "is_sleeping": False,
    }


@pytest.mark.parametrize(
    ("payload", "rule"),
    [
        ({"command": "reboot"}, "Invalid enum value 'reboot' - at `$.command`"),
        ({"command": "sleep", "level": 3}, "Expected `int` <= 2 - at `$.level`"),
        ({"lora_name": "a"}, "Object missing required field `command`"),
    ],
    ids=["unknown-command", "sleep-level", "no-command"],
)
async def test_a_bad_command_is_answered_invalid_request_naming_the_field(
    payload: dict[str, Any], rule: str
) -> None:
    control, _, nc = control_on(FakeAdmin())
    await control._on_message(_Msg(MSGPACK.encode(payload)))  # type: ignore[arg-type]
    ((_, data),) = nc.messages
    reply = msgspec.msgpack.decode(data)
    assert reply["error"]["code"] == "invalid_request"
    assert reply["error"]["message"] == f"invalid payload: {rule}"


async def test_an_engine_without_admin_commands_says_so() -> None:
    control, _, _ = control_on(None)
    reply = await control.run(ControlRequest(command="is_sleeping"))
    assert reply.error is not None and reply.error.code == "invalid_request"
    assert reply.error.message == "this worker's engine takes no commands"


async def test_a_sleeping_worker_refuses_new_requests_retryably_until_woken() -> None:
    admin = FakeAdmin()
    control, _, _ = control_on(admin)
    service = control.service
    slept = await control.run(ControlRequest(command="sleep", level=1))
    assert slept.error is None and slept.is_sleeping is True and service.asleep
    frame = await refused(service, delivery(make_request("zz", [1, 2], max_tokens=1)))
    assert frame["error"]["code"] == "overloaded"
    assert frame["error"]["message"] == "worker is asleep (/sleep): retry on another worker"
    woke = await control.run(ControlRequest(command="wake_up"))
    assert woke.error is None and woke.is_sleeping is False and not service.asleep
    await served(service, delivery(make_request("awake", [1, 2], max_tokens=1)))
