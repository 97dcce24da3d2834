"""The frontend's model catalog (worker/frontend/catalog.py) without a server: which model a
request's `model` names, from what the workers announced (fleet Members set by hand), and the
`/v1/models` cards; a discovered model's tokenizer made once on its first request.

The rules: the configured model (`--model`) answers its names and a request without `model`;
a discovered model answers its served name, a default request of its kind when no model is
configured; an adapter a worker holds answers as itself on its parent model; another kind's
model is a 400; a name no live worker serves is a 404 (after one fresh discovery round)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.test_frontend_shapes import TOKENIZER
from worker.client.fleet import Member
from worker.frontend.catalog import Card, ModelCatalog, ServedModel
from worker.frontend.errors import OpenAIError
from worker.frontend.settings import FrontendSettings

CHAT = Member(
    "w1", {"lora-a": "/adapters/a"}, "llm.chat.generate", False, "chat", "generate", "/m/chat", 512
)
CHAT_2 = Member("w2", {"lora-b": "/adapters/b"}, "llm.chat.generate", False, "chat", "generate",
                "/m/chat", 512)  # fmt: skip
EMBED = Member("w3", {}, "llm.emb.embed", True, "emb", "embed", "/m/emb", 256)


class Catalog(ModelCatalog):
    """A catalog whose discovery round is counted and finds `later` (members that came since)."""

    def __init__(self, configured: ServedModel | None, members: list[Member]) -> None:
        super().__init__(FrontendSettings(router="queue"), configured)
        self.members = members
        self.later: list[Member] = []
        self.rounds = 0
        self._tokenizers = {"/m/chat": TOKENIZER, "/m/emb": TOKENIZER}

    async def refresh(self) -> None:
        self.rounds += 1
        self.members = self.members + self.later


def configured(**fields: Any) -> ServedModel:
    settings: dict[str, Any] = dict(
        names=("m", "m-alias"),
        kind="generate",
        subject="llm.vllm.generate",
        jetstream=False,
        root="/m/configured",
        tokenizer=TOKENIZER,
        configured=True,
    )
    settings.update(fields)
    return ServedModel(**settings)


async def test_discovered_models_and_their_adapters_are_found_by_name() -> None:
    catalog = Catalog(None, [CHAT, CHAT_2, EMBED])
    chat = await catalog.resolve("chat", "generate")
    assert (chat.name, chat.adapter, chat.model.subject) == ("chat", None, "llm.chat.generate")
    assert chat.model.tokenizer is TOKENIZER and not chat.model.configured
    # The model is made once: the same object answers its adapters' requests.
    for adapter in ("lora-a", "lora-b"):
        target = await catalog.resolve(adapter, "generate")
        assert (target.name, target.adapter, target.model) == (adapter, adapter, chat.model)
    embed = await catalog.resolve("emb", "embed")
    assert (embed.model.kind, embed.model.jetstream) == ("embed", True)
    # Without a configured model, a request without `model` gets the first model of its kind.
    assert (await catalog.resolve(None, "generate")).name == "chat"
    assert (await catalog.resolve(None, "embed")).name == "emb"
    assert catalog.rounds == 0


async def test_unknown_names_are_404_after_one_fresh_round_and_kinds_are_checked() -> None:
    catalog = Catalog(None, [CHAT])
    with pytest.raises(OpenAIError) as missing:
        await catalog.resolve("nope", "generate")
    assert (missing.value.status, missing.value.message) == (
        404,
        "The model `nope` does not exist.",
    )
    assert catalog.rounds == 1
    catalog.later = [EMBED]  # it came since the last round: found by the fresh one
    assert (await catalog.resolve("emb", "embed")).name == "emb"
    with pytest.raises(OpenAIError) as wrong:
        await catalog.resolve("chat", "embed")
    assert wrong.value.status == 400
    assert wrong.value.message == "model: `chat` is a generate model, not a embed model"
    # Any kind, for the admin routes and /tokenize.
    assert (await catalog.resolve("emb", None)).model.kind == "embed"
    with pytest.raises(OpenAIError) as none:
        await Catalog(None, [EMBED]).resolve(None, "generate")
    assert none.value.status == 400
    assert none.value.message == "model: no generate model is served: name one"


async def test_a_model_whose_last_worker_left_is_not_found() -> None:
    catalog = Catalog(None, [CHAT, EMBED])
    await catalog.resolve("emb", "embed")
    catalog.members = [CHAT]
    with pytest.raises(OpenAIError) as gone:
        await catalog.resolve("emb", "embed")
    assert gone.value.status == 404
    assert [card.name for card in catalog.cards()] == ["chat", "lora-a"]


async def test_the_configured_model_keeps_its_names_and_its_workers_adapters() -> None:
    own = Member("w9", {"lora-c": "/adapters/c"}, "llm.vllm.generate", False, "/m/configured",
                 "generate", "/m/configured", 1024)  # fmt: skip
    catalog = Catalog(configured(), [own, CHAT])
    default = await catalog.resolve(None, "generate")
    assert (default.name, default.model.configured) == ("m", True)
    assert (await catalog.resolve("m-alias", "generate")).name == "m-alias"
    lora = await catalog.resolve("lora-c", "generate")
    assert (lora.adapter, lora.model.configured) == ("lora-c", True)
    assert (await catalog.resolve("chat", "generate")).model.subject == "llm.chat.generate"
    assert catalog.cards() == [
        Card("m", "/m/configured", None, 1024),
        Card("m-alias", "/m/configured", None, 1024),
        Card("chat", "/m/chat", None, 512),
        Card("lora-c", "/adapters/c", "m", None),
        Card("lora-a", "/adapters/a", "chat", None),
    ]
    # With no worker of it, the configured model is still listed (its workers may come).
    assert Catalog(configured(), [])._find("m", "generate") is not None
    assert Catalog(configured(), []).cards() == [
        Card("m", "/m/configured", None, None),
        Card("m-alias", "/m/configured", None, None),
    ]
