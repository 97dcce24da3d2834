"""`sampling_options.guided_decoding` → vLLM's own StructuredOutputsParams, and vLLM's refusals
of a constraint → InvalidRequest naming that field, with the backend's reason.

vLLM 0.24 and 0.32 both take `SamplingParams(structured_outputs=StructuredOutputsParams(...))`
(the older GuidedDecodingParams / `guided_decoding=` were removed in 0.11), with the same fields.
They check a constraint in two places:

1. When the request is added (in this process): `SamplingParams.verify` parses the constraint
   with the engine's backend and raises (VLLMValidationError on 0.32, a ValueError on 0.24) with
   the backend's message. `is_constraint_error` tells such an error from the request's other
   input errors by where it was raised (vLLM's structured-output validation).
2. In the engine core, which compiles the constraint against the tokenizer. On 0.32 a compile
   error ends the request with finish_reason "error" and no tokens (the reason goes only to the
   engine core's log); on 0.24, which predates vLLM's fix (PR #47312), it kills the EngineCore.

The engine core keeps one backend for its lifetime: the one its first structured request resolved
to. With `--structured-outputs-config.backend auto` (the default) vLLM resolves each request on
its own, xgrammar first and guidance or outlines where xgrammar refuses the constraint, so a later
request can be validated by guidance and then compiled by the core's xgrammar: on 0.32 it fails in
the core, on 0.24 it kills the engine (vLLM issue #43920). So the worker pins "auto" to
xgrammar: it checks each constraint with vLLM's own xgrammar validation before vLLM does and
refuses what xgrammar refuses, with xgrammar's reason. Every request then resolves to xgrammar,
the backend the core latched. What xgrammar parses but still cannot compile (rare) remains the
core's to refuse: on 0.32 that is turned into InvalidRequest here (`compile_failure`).
"""

from __future__ import annotations

import json
import re
from types import TracebackType
from typing import Any

from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams

from messages.request import GuidedDecoding
from worker.engine.contract import InvalidRequest
from worker.errors import describe

try:  # vLLM's own check of a constraint against xgrammar (0.24 and 0.32)
    from vllm.v1.structured_output.backend_xgrammar import (
        validate_xgrammar_grammar as _validate_xgrammar,
    )
except ImportError:  # pragma: no cover - a vLLM without it: no pinning
    _validate_xgrammar = None

FIELD = "sampling_options.guided_decoding"
# xgrammar prefixes its native errors with a time and a source line ("[11:08:46] x.cc:83: ").
_NATIVE_PREFIX = re.compile(r"\[\d{2}:\d{2}:\d{2}\] \S+?:\d+: ")


def engine_backend(llm: Any) -> str:
    """The engine's configured structured-output backend (`--structured-outputs-config`)."""
    config = getattr(getattr(llm, "vllm_config", None), "structured_outputs_config", None)
    return str(getattr(config, "backend", None) or "auto")


def _reason(error: BaseException) -> str:
    """vLLM's message, with the backend's own where vLLM keeps it as the cause ("Invalid grammar
    specification." from "Rule 'x' not found")."""
    message = str(error) or describe(error)
    cause = error.__cause__
    if cause is not None and str(cause) and str(cause) not in message:
        message = f"{message.rstrip('.')}: {cause}"
    return _NATIVE_PREFIX.sub("", message).strip()


def is_constraint_error(error: BaseException) -> bool:
    """Whether vLLM raised `error` while checking a structured-output constraint: on its way up
    it passed vLLM's `_validate_structured_output(s)` or a module of vllm.v1.structured_output
    (where 0.24 and 0.32 both check constraints)."""
    trace: TracebackType | None = error.__traceback__
    while trace is not None:
        frame = trace.tb_frame
        module = str(frame.f_globals.get("__name__", ""))
        if module.startswith("vllm.") and (
            "structured_output" in frame.f_code.co_name or "structured_output" in module
        ):
            return True
        trace = trace.tb_next
    return False


def refusal(error: BaseException) -> InvalidRequest:
    """vLLM's refusal of the constraint as the wire's error."""
    return InvalidRequest(FIELD, _reason(error))


class StructuredOutputs:
    """Builds each request's StructuredOutputsParams for an engine with `backend`."""

    def __init__(self, backend: str) -> None:
        self.configured = backend
        self.pinned = backend == "auto" and _validate_xgrammar is not None
        # The backend every constraint runs on: the configured one, xgrammar for a pinned "auto".
        self.backend = "xgrammar" if self.pinned else backend

    def params(self, guided: GuidedDecoding) -> StructuredOutputsParams:
        """vLLM's parameters for an arrived guided_decoding (worker.validation has checked its
        shape). Raises InvalidRequest for what this engine cannot honour."""
        requested = guided.backend
        if requested not in (None, "auto", self.backend):
            raise InvalidRequest(
                f"{FIELD}.backend",
                f"this engine runs structured outputs on {self.backend!r} (vLLM chooses the "
                "backend per engine, --structured-outputs-config.backend, not per request): "
                f"send 'auto', {self.backend!r} or none, got {requested!r}",
            )
        if guided.whitespace_pattern is not None:
            raise InvalidRequest(
                f"{FIELD}.whitespace_pattern",
                "not supported: vLLM's structured-output backends do not apply it "
                "(vLLM would accept it and ignore it)",
            )
        if self.pinned:
            self._check_with_xgrammar(guided)
        try:
            return self._build(guided)
        except Exception as error:  # vLLM's own checks of the fields (one constraint, …)
            raise refusal(error) from error

    @staticmethod
    def _build(guided: GuidedDecoding) -> StructuredOutputsParams:
        tag = guided.structural_tag
        return StructuredOutputsParams(
            json=guided.json,
            regex=guided.regex,
            choice=list(guided.choice) if guided.choice is not None else None,
            grammar=guided.grammar,
            json_object=guided.json_object,
            structural_tag=json.dumps(tag) if isinstance(tag, dict) else tag,
        )

    def _check_with_xgrammar(self, guided: GuidedDecoding) -> None:
        """vLLM's own xgrammar check on a copy (it rewrites a choice into a grammar in place)."""
        assert _validate_xgrammar is not None
        try:
            probe = SamplingParams(max_tokens=1, structured_outputs=self._build(guided))
            _validate_xgrammar(probe)
        except Exception as error:  # whatever vLLM's validator raises is about the constraint
            raise InvalidRequest(
                FIELD, f"refused by xgrammar, this engine's backend: {_reason(error)}"
            ) from error

    def compile_failure(self) -> InvalidRequest:
        """A constraint vLLM's engine core could not compile (0.32: the request ends with
        finish_reason "error" before any token; the backend's reason is in the core's log)."""
        return InvalidRequest(
            FIELD,
            f"vLLM's engine core could not compile the constraint with its {self.backend} "
            "backend (the engine's log has the backend's reason)",
        )
