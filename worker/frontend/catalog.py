"""The models one frontend serves: the one it was started with (`--model`, optional) and every
model whose workers answer discovery on the NATS cluster, with their LoRA adapters.

How models are learnt: every `refresh_s` (and once more before a name is called unknown) the
frontend asks `$SRV.INFO` of every worker (worker/client/fleet.py). Each worker's metadata names
its served model, what it serves (`kind`: generate or embed), its subject, its work queue if
any, its `max_model_len`, the adapters it holds and where its tokenizer is (`tokenizer`: the
engine's `--tokenizer` or `--model`, a path the frontend must be able to read, or a hub name).
A model is served while one of its workers answers; once its last worker is gone its name is a
404 (`model_not_found`), as vLLM's server answers a name it does not serve.

What a model needs on this side is made on its first request and kept: its tokenizer (loaded
once per path, in a thread, `ModelTokenizer.load`) and, for generation in core mode, a KV router
of its own subject (one cache picture per model).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS

from worker.client import KvRouter, fleet, subjects_of
from worker.frontend.errors import invalid, unknown_model
from worker.frontend.settings import FrontendSettings
from worker.frontend.tokenizer import ModelTokenizer
from worker.shared.log_text import loggable

log = logging.getLogger(__name__)


@dataclass
class ServedModel:
    """A model requests are sent for: the names clients use, its workers' subject, its
    tokenizer and (core-mode generation) its KV router."""

    names: tuple[str, ...]
    kind: str
    subject: str
    jetstream: bool
    root: str
    """Its tokenizer's path: `/v1/models`' `root`."""
    tokenizer: ModelTokenizer
    router: KvRouter | None = None
    configured: bool = False
    """The model the frontend was started with (`--model`)."""


@dataclass(frozen=True)
class Target:
    """What one request names: the model it goes to, the name its response carries, and the
    wire's `model` (a LoRA adapter's name; None for the base model)."""

    model: ServedModel
    name: str
    adapter: str | None


@dataclass(frozen=True)
class Card:
    """One `/v1/models` entry: a model, or an adapter (with its parent model)."""

    name: str
    root: str
    parent: str | None
    max_model_len: int | None


@dataclass
class ModelCatalog:
    settings: FrontendSettings
    configured: ServedModel | None
    on_router: Callable[[KvRouter], Awaitable[None]] | None = None
    members: list[fleet.Member] = field(default_factory=list)
    _models: dict[str, ServedModel] = field(default_factory=dict)
    _making: dict[str, asyncio.Future[ServedModel]] = field(default_factory=dict)
    _tokenizers: dict[str, ModelTokenizer] = field(default_factory=dict)
    _nc: NATS | None = None
    _refresher: asyncio.Task[None] | None = None

    async def start(self, nc: NATS, refresh_s: float) -> None:
        self._nc = nc
        if self.configured is not None:
            await self._start_router(self.configured)
        await self.refresh()
        self._refresher = asyncio.create_task(self._refresh_every(refresh_s))

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        models = list(self._models.values())
        if self.configured is not None:
            models.append(self.configured)
        for model in models:
            if model.router is not None:
                await model.router.stop()

    async def _refresh_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.refresh()
            except Exception as error:  # a broken connection: the next round tries again
                log.info("model discovery failed: %r", error)

    async def refresh(self) -> None:
        """What every worker of the cluster serves now (one discovery round)."""
        nc = self._nc
        if nc is None or not nc.is_connected:
            return
        self.members = await fleet.everyone(nc, window=self.settings.discovery_window_s)

    def _of(self, subject: str) -> list[fleet.Member]:
        return [m for m in self.members if m.subject == subject]

    def _discovered(self) -> list[fleet.Member]:
        """The workers of models other than the configured one."""
        configured = self.configured
        return [m for m in self.members if configured is None or m.subject != configured.subject]

    def adapters(self, subject: str) -> dict[str, str]:
        """The adapters some worker of `subject` holds: name → path."""
        return {name: path for m in self._of(subject) for name, path in m.adapters.items()}

    def max_model_len(self, subject: str) -> int | None:
        return next((m.max_model_len for m in self._of(subject) if m.max_model_len), None)

    def cards(self) -> list[Card]:
        """Every model and adapter with a live worker (the configured model always), models
        first, each adapter after its parent."""
        models: list[Card] = []
        adapters: list[Card] = []
        subjects: list[tuple[str, str]] = []  # (subject, the name its adapters' parent is)
        if (configured := self.configured) is not None:
            length = self.max_model_len(configured.subject)
            models += [Card(n, configured.root, None, length) for n in configured.names]
            subjects.append((configured.subject, configured.names[0]))
        for member in self._discovered():
            if any(card.name == member.model for card in models):
                continue
            root = member.tokenizer or member.model
            models.append(Card(member.model, root, None, member.max_model_len))
            subjects.append((member.subject, member.model))
        for subject, parent in subjects:
            for name, path in sorted(self.adapters(subject).items()):
                adapters.append(Card(name, path, parent, None))
        return models + adapters

    async def resolve(self, name: str | None, kind: str | None) -> Target:
        """The model a request's `model` names (None: the default one of `kind`, a generator
        for any kind), its tokenizer and router made on its first request: a 404 for a name no
        live worker serves, a 400 for a model of another kind."""
        found = self._find(name, kind or "generate")
        if found is None and name is not None:
            await self.refresh()  # a model or adapter that came in the last refresh_s
            found = self._find(name, kind or "generate")
        if found is None:
            if name is None:
                raise invalid("model", f"no {kind} model is served: name one")
            raise unknown_model(name)
        where, served_name, adapter = found
        model = where if isinstance(where, ServedModel) else await self._model_of(where)
        if kind is not None and model.kind != kind:
            raise invalid("model", f"`{served_name}` is a {model.kind} model, not a {kind} model")
        return Target(model, served_name, adapter)

    def _find(
        self, name: str | None, kind: str
    ) -> tuple[ServedModel | fleet.Member, str, str | None] | None:
        """(the configured model or a discovered model's worker, the name, the adapter)."""
        configured = self.configured
        if configured is not None and (name is None and kind == configured.kind):
            return configured, configured.names[0], None
        if configured is not None and name in configured.names:
            return configured, name, None
        members = self._discovered()
        if name is None:
            models = sorted(m.model for m in members if m.kind == kind)
            if not models:
                return None
            name = models[0]
        for member in members:
            if member.model == name:
                return member, name, None
        if configured is not None and name in self.adapters(configured.subject):
            return configured, name, name
        for member in members:
            if name in member.adapters:
                return member, name, name
        return None

    async def _model_of(self, member: fleet.Member) -> ServedModel:
        model = self._models.get(member.model)
        if model is not None and model.subject == member.subject:
            return model
        return await self._make(member)

    async def _make(self, member: fleet.Member) -> ServedModel:
        making = self._making.get(member.model)
        if making is None:
            making = asyncio.ensure_future(self._new_model(member))
            self._making[member.model] = making
            making.add_done_callback(lambda _: self._making.pop(member.model, None))
        return await making

    async def _new_model(self, member: fleet.Member) -> ServedModel:
        path = member.tokenizer or member.model
        tokenizer = self._tokenizers.get(path)
        if tokenizer is None:
            log.info("model %s: loading its tokenizer from %s", loggable(member.model), path)
            try:
                tokenizer = await asyncio.to_thread(ModelTokenizer.load, path)
            except Exception as error:
                raise invalid(
                    "model", f"`{member.model}`: its tokenizer ({path}) cannot be loaded here: "
                    f"{error}"
                ) from error  # fmt: skip
            self._tokenizers[path] = tokenizer
        model = ServedModel(
            (member.model,), member.kind, member.subject, member.jetstream, path, tokenizer
        )
        if member.kind == "generate":
            await self._start_router(model)
        old = self._models.get(member.model)
        if old is not None and old.router is not None:
            await old.router.stop()
        self._models[member.model] = model
        return model

    async def _start_router(self, model: ServedModel) -> None:
        settings = self.settings
        if self._nc is None or model.jetstream or settings.router == "queue":
            return
        router = KvRouter(
            self._nc,
            subjects_of(model.subject),
            mode=settings.router,
            load_weight=settings.load_weight,
        )
        await router.start()
        model.router = router
        if self.on_router is not None:
            await self.on_router(router)
