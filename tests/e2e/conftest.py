"""Fixtures of the e2e layer's migration tests (tests/e2e/test_migration.py): one undisturbed run
of their 64 streams, made once on the session's engine."""

from __future__ import annotations

import asyncio

import pytest

from messages.request import GenerateRequest
from worker.client import Completion, complete
from worker.client.requests import make_request

MIGRATED_STREAMS, MIGRATED_TOKENS = 64, 300


def migrated_request(i: int, request_id: str | None = None) -> GenerateRequest:
    """Stream `i` of the 64 the migration tests run: 300 greedy tokens with logprobs 5."""
    prompt = [1, 40 + i, 300 + i % 7, 500 + i % 11]
    return make_request(request_id or f"mig-{i}", prompt, max_tokens=MIGRATED_TOKENS, logprobs=5)


@pytest.fixture(scope="session")
async def undisturbed(worker, client) -> list[Completion]:
    """The 64 streams as the session's worker alone answers them."""
    subject = worker.config.subjects.generate
    return list(
        await asyncio.gather(
            *(complete(client, migrated_request(i), subject=subject) for i in range(64))
        )
    )
