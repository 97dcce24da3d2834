"""N worker processes over one vLLM engine core, the way `vllm serve --api-server-count N` scales
its front end, with vLLM's own pieces: the parent binds the engine's ZMQ listeners for N clients,
launches the engine core once (`launch_core_engines`) and starts N processes with vLLM's
`APIServerProcessManager`, whose target here is the worker's own client process; each child
runs an `AsyncLLM` client of the shared core (`client_config`: its addresses, `client_count`,
`client_index`) and a NATS worker of its own. The parent then waits with vLLM's
`wait_for_completion_or_failure`: any child or the engine core dying ends the whole worker
non-zero (the rest are shut down), never a half-alive worker; SIGTERM/SIGINT shut the children
down (each drains) and then the core.

The launch API differs across the vLLM range this project claims, and this module is the one
place that knows it (`_launch`): vLLM 0.32+ binds the listeners in the parent
(`bind_engine_zmq_listeners`) and `launch_core_engines` yields a `CoreEngineLaunch`; vLLM 0.24
allocates addresses (`get_engine_zmq_addresses`), `launch_core_engines(..., num_api_servers)`
yields a 4-tuple, and the children report the endpoints they bound
(`gather_actual_addresses`). The children's side (`client_llm`) is the same in both. Any other
launch API gets a clear error naming the vLLM version. The 0.32 path runs in CI on CPU; the 0.24
path was written from vLLM 0.24.0's source (entrypoints/cli/serve.py `run_multi_api_server`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from worker.config import ENGINE_EXIT_GRACE_S
from worker.engine import placement
from worker.engine.args import usage_context

log = logging.getLogger(__name__)

ClientTarget = Callable[[str, Any, argparse.Namespace, dict[str, Any]], None]
"""What each process runs: (listen_address, sock, args, client_config), as vLLM calls it."""


class ScaleOutUnsupported(RuntimeError):
    """This vLLM's launch API is not one this module knows."""


def _api() -> str:
    """Which launch API this vLLM has: "listeners" (0.32+) or "addresses" (0.24)."""
    from vllm import __version__
    from vllm.v1.engine import utils as engine_utils

    if hasattr(engine_utils, "bind_engine_zmq_listeners"):
        return "listeners"
    if hasattr(engine_utils, "get_engine_zmq_addresses"):
        return "addresses"
    raise ScaleOutUnsupported(
        f"--worker-processes > 1 knows vLLM's front-end scale-out API of 0.24 and 0.32+; this is "
        f"vLLM {__version__}, which has neither: run --worker-processes 1, or several workers"
    )


def check_supported() -> None:
    _api()


def client_engine_args(engine_args: Any, client_config: dict[str, Any]) -> Any:
    """The engine arguments of one client process (vLLM sizes per-client state by them)."""
    engine_args._api_process_count = client_config.get("client_count", 1)
    engine_args._api_process_rank = client_config.get("client_index", 0)
    return engine_args


def client_llm(
    engine_args: Any, client_config: dict[str, Any], stat_loggers: list[Any] | None = None
) -> Any:
    """An AsyncLLM client of the shared engine core, from a child's `client_config`."""
    from vllm.v1.engine.async_llm import AsyncLLM

    config = dict(client_config)
    count = config.pop("client_count", 1)
    index = config.pop("client_index", 0)
    vllm_config = client_engine_args(engine_args, client_config).create_engine_config(
        usage_context()
    )
    return AsyncLLM.from_vllm_config(
        vllm_config,
        disable_log_stats=engine_args.disable_log_stats,
        client_addresses=config,
        client_count=count,
        client_index=index,
        stat_loggers=stat_loggers,
    )


def run(
    engine_args: Any,
    args: argparse.Namespace,
    processes: int,
    target: ClientTarget,
    shutdown_timeout_s: float,
    where: placement.Placement | None = None,
) -> int:
    """Runs the engine core and `processes` client processes until one dies (exit 1) or
    SIGTERM/SIGINT (exit 0 once every child has drained). Blocks. `where`: the engine core's
    CPUs and the rest's (`--engine-core-cpus`, worker/engine/placement.py)."""
    from vllm.v1.engine.utils import launch_core_engines
    from vllm.v1.executor import Executor
    from vllm.v1.utils import APIServerProcessManager, wait_for_completion_or_failure

    engine_args._api_process_count = processes
    engine_args._api_process_rank = -1
    vllm_config = engine_args.create_engine_config(usage_context=usage_context())
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            # vLLM's wait, still running in its thread, sees the processes end as they stop
            # and reports each as a failure: not one.
            _VLLM_WAIT_LOG.addFilter(_drop_all)
            log.info("signal %d: shutting the worker processes down (each drains)", signum)
            raise SystemExit

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    manager = engine_manager = coordinator = None
    executor_class = Executor.get_class(vllm_config)
    log_stats = not engine_args.disable_log_stats
    # What both launch APIs give vLLM's process manager alike: no HTTP listener, the worker's
    # own process function.
    common: dict[str, Any] = dict(
        listen_address="", sock=None, args=args, num_servers=processes, target_server_fn=target
    )
    try:
        if _api() == "listeners":  # vLLM 0.32+
            from vllm.v1.engine.utils import bind_engine_zmq_listeners

            listeners = bind_engine_zmq_listeners(vllm_config, processes)
            with contextlib.ExitStack() as launched:
                with placement.engine_core_launch(where):
                    launch = launched.enter_context(
                        launch_core_engines(
                            vllm_config, executor_class, log_stats, listeners.addresses
                        )
                    )
                engine_manager, coordinator = launch.engine_manager, launch.coordinator
                manager = APIServerProcessManager(
                    **common,
                    input_listeners=listeners.inputs,
                    output_listeners=listeners.outputs,
                    stats_update_address=_stats_address(coordinator),
                    tensor_queue=launch.tensor_queue,
                )
                launch.watched_frontend_processes = manager.processes
        else:  # vLLM 0.24
            from vllm.v1.engine.utils import get_engine_zmq_addresses

            addresses = get_engine_zmq_addresses(vllm_config, processes)
            with contextlib.ExitStack() as launched:
                with placement.engine_core_launch(where):
                    engine_manager, coordinator, addresses, tensor_queue = launched.enter_context(
                        launch_core_engines(
                            vllm_config, executor_class, log_stats, addresses, processes
                        )
                    )
                manager = APIServerProcessManager(
                    **common,
                    input_addresses=addresses.inputs,
                    output_addresses=addresses.outputs,
                    stats_update_address=_stats_address(coordinator),
                    tensor_queue=tensor_queue,
                )
                # The children bind their own endpoints; the engine's handshake (on `with`
                # exit) needs the ones they got.
                addresses.inputs, addresses.outputs = manager.gather_actual_addresses()
        _wait_in_a_thread(wait_for_completion_or_failure, manager, engine_manager, coordinator)
        return 0
    except SystemExit:
        return 0 if stopping else 1
    except Exception as error:
        log.error("worker processes: %s", error)
        return 1
    finally:
        if manager is not None:
            manager.shutdown(timeout=shutdown_timeout_s)
        if engine_manager is not None:
            engine_manager.shutdown(timeout=ENGINE_EXIT_GRACE_S)
        if coordinator is not None:
            coordinator.shutdown(timeout=10)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _VLLM_WAIT_LOG.removeFilter(_drop_all)


_VLLM_WAIT_LOG = logging.getLogger("vllm.v1.utils")
"""The logger of vLLM's `wait_for_completion_or_failure`."""


def _drop_all(record: logging.LogRecord) -> bool:
    return False


def _wait_in_a_thread(wait: Callable[..., None], *managers: Any) -> None:
    """vLLM's wait for the processes to end, run in a thread of its own while this (main) thread,
    the one that runs Python's signal handlers, wakes every half second. The kernel may deliver
    SIGTERM to any thread of the process (the metrics server's, vLLM's engine monitor); a main
    thread blocked in vLLM's `select` for a process to end would then never run the handler, and
    the worker would neither drain nor exit (tests/e2e/test_scaleout.py sends the signal to
    another thread). Re-raises what the wait raised."""
    failure: list[BaseException] = []

    def run_wait() -> None:
        try:
            wait(*managers)
        except BaseException as error:  # re-raised in the main thread
            failure.append(error)

    waiter = threading.Thread(target=run_wait, name="process-waiter", daemon=True)
    waiter.start()
    while waiter.is_alive():
        waiter.join(0.5)
    if failure:
        raise failure[0]


def _stats_address(coordinator: Any) -> str | None:
    return coordinator.get_stats_publish_address() if coordinator else None


def summed_metrics_registry() -> Any:
    """A registry that sums the metrics of every process started after this call
    (prometheus-client's multiprocess mode, set up by vLLM's own helper as `--api-server-count`
    does: it points PROMETHEUS_MULTIPROC_DIR at a temporary directory)."""
    from prometheus_client import CollectorRegistry, multiprocess
    from vllm.v1.metrics.prometheus import setup_multiprocess_prometheus

    setup_multiprocess_prometheus()
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return registry
