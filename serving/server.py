"""`pallasite serve`: the gRPC and OpenAI HTTP servers around the Generation service.

    pallasite serve --model PATH --port 50051 --metrics-port 9090
    pallasite serve --model PATH --http-port 8000            (HTTP only; add --port for both)

The port opens at once, with the standard health service reporting NOT_SERVING and generation
calls answered UNAVAILABLE while the model loads and compiles; then SERVING. Server reflection
lists the services. SIGTERM or SIGINT drains: health NOT_SERVING, new calls UNAVAILABLE, calls
under way get a grace period and are then aborted, and the process exits 0. Prometheus metrics
are served over HTTP; each generation writes one JSON log line (logger pallasite.serving.requests).
The OpenAI-compatible API (serving/http.py) runs on the same event loop and engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import contextlib
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import grpc

from .metrics import Metrics
from .proto import SERVICE_NAME, pb_grpc
from .service import DRAINING, GenerationService

log = logging.getLogger("pallasite.serving.server")

# Health and reflection come from their own packages (dependencies of pallasite). A machine that
# lacks one still serves, without that service, and says so at start.
try:
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
except ImportError:
    health = None
try:
    from grpc_reflection.v1alpha import reflection
except ImportError:
    reflection = None


class Server:
    """The gRPC server, its health and metrics, and its lifecycle: start, load, drain."""

    def __init__(self, *, host: str = "0.0.0.0", port: int | None = 50051,
                 metrics_port: int | None = None, max_queue: int = 1024, grace_s: float = 30.0,
                 http_port: int | None = None):
        """port None: no gRPC; http_port None: no HTTP (0 for either: any free port)."""
        self.host, self.port, self.metrics_port = host, port, metrics_port
        self.http_port, self.http = http_port, None
        self.grace_s = grace_s
        self.metrics = Metrics()
        self.service = GenerationService(self.metrics, max_queue)
        self.health = health.aio.HealthServicer() if health else None
        self.grpc = None

    async def start(self) -> int | None:
        """Open the ports (NOT_SERVING until `load` finishes); returns the gRPC port bound."""
        if self.http_port is not None:
            await self._start_http()
        if self.port is not None:
            await self._start_grpc()
        if self.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(self.metrics_port, addr=self.host)
        return self.port

    async def _start_http(self):
        import uvicorn
        from .http import create_app

        class Uvicorn(uvicorn.Server):
            def capture_signals(self):  # the process's signals are `serve`'s, which drains
                return contextlib.nullcontext()

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.http_port))
        self.http_port = sock.getsockname()[1]
        config = uvicorn.Config(create_app(self.service), log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=1)
        self.http = Uvicorn(config)
        self._http_task = asyncio.create_task(self.http.serve(sockets=[sock]))
        while not self.http.started and not self._http_task.done():
            await asyncio.sleep(0.01)

    async def _start_grpc(self):
        self.grpc = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_GenerationServicer_to_server(self.service, self.grpc)
        services = [SERVICE_NAME]
        if health:
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
            services.append(health.SERVICE_NAME)
            await self._set_health("NOT_SERVING")
        else:
            log.warning("grpcio-health-checking is not installed: no health service")
        if reflection:
            reflection.enable_server_reflection(services + [reflection.SERVICE_NAME], self.grpc)
        else:
            log.warning("grpcio-reflection is not installed: no server reflection")
        bound = self.grpc.add_insecure_port(f"{self.host}:{self.port}")
        if not bound:
            raise OSError(f"cannot listen on {self.host}:{self.port}")
        self.port = bound
        await self.grpc.start()

    async def _set_health(self, status: str):
        if self.health is None:
            return
        for name in ("", SERVICE_NAME):  # "" is the whole server
            await self.health.set(name, health_pb2.HealthCheckResponse.ServingStatus.Value(status))

    async def load(self, make_llm, model_name: str = ""):
        """Build the LLM (load and warm up) on a thread of its own, then serve it."""
        done = asyncio.get_running_loop().create_future()

        def build():
            try:
                result = (make_llm(), None)
            except BaseException as e:  # handed to the event loop, which reports it
                result = (None, e)
            done.get_loop().call_soon_threadsafe(done.set_result, result)

        # A daemon thread, so that a shutdown during a long warm-up need not wait for it.
        threading.Thread(target=build, name="pallasite-load", daemon=True).start()
        llm, error = await done
        if error is not None:
            raise error
        if self.service.state == DRAINING:  # shut down while loading
            llm.close()
            return
        self.service.ready(llm, model_name)
        self.metrics.watch_engine(llm.engine)
        await self._set_health("SERVING")
        log.info("serving %s on %s", model_name or "the model", ", ".join(
            f"{kind} port {p}" for kind, p in (("gRPC", self.port), ("HTTP", self.http_port))
            if p is not None))

    async def drain(self, grace_s: float | None = None):
        """Stop taking calls, give those under way `grace_s` to finish, abort the rest, stop."""
        grace_s = self.grace_s if grace_s is None else grace_s
        self.service.state = DRAINING
        if self.health is not None:
            await self.health.enter_graceful_shutdown()  # NOT_SERVING, and stays so
        deadline = time.monotonic() + grace_s
        while self.service.calls and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.service.calls:
            log.warning("grace period over: aborting %d requests", len(self.service.calls))
            self.service.abort_all()
            for _ in range(100):  # their calls end UNAVAILABLE within a step or two
                if not self.service.calls:
                    break
                await asyncio.sleep(0.01)
        if self.grpc is not None:
            await self.grpc.stop(1.0)
        if self.http is not None:
            self.http.should_exit = True
            await self._http_task
        self.metrics.close()


class BackgroundServer:
    """A Server on an event loop of its own thread: for tests, and for serving from a program
    that already has its LLM (`BackgroundServer(lambda: llm, port=0)`)."""

    def __init__(self, make_llm, model_name: str = "", **server_kwargs):
        self.server = Server(**server_kwargs)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="pallasite-grpc",
                                        daemon=True)
        self._thread.start()
        self.port = self.run(self.server.start())
        self.loaded = asyncio.run_coroutine_threadsafe(self.server.load(make_llm, model_name),
                                                       self.loop)

    def run(self, coro, timeout: float | None = None):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def service(self) -> GenerationService:
        return self.server.service

    def wait_ready(self, timeout: float | None = None):
        self.loaded.result(timeout)
        return self

    def drain(self, grace_s: float | None = None):
        self.run(self.server.drain(grace_s))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()


# -- pallasite serve ----------------------------------------------------------------------------
def add_arguments(parser):
    parser.add_argument("--model", default=None,
                        help="Hugging Face checkpoint folder or Hub name org/name[@revision] "
                        "(default: the embedded model)")
    parser.add_argument("--served-model-name", default=None,
                        help="name reported by ModelInfo (default: the Hub name or the folder's name)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=None,
                        help="gRPC port (0: any free port; default 50051, or none when only "
                             "--http-port is given)")
    parser.add_argument("--http-port", type=int, default=None,
                        help="OpenAI-compatible HTTP API port (0: any free port; default: off)")
    parser.add_argument("--metrics-port", type=int, default=9090,
                        help="Prometheus /metrics HTTP port (0: any free port, -1: off)")
    parser.add_argument("--random-weights", action="store_true",
                        help="random weights for the config.json in --model, made on the device "
                             "(benchmarks; with no tokenizer, prompts must be token ids)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                        help="weights' dtype (default: bfloat16 on GPU, float32 on CPU)")
    add_quantization_argument(parser)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="most tokens of prompt plus completion")
    from .llm import KV_CACHE_DTYPES
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                        help="KV cache pages: 'auto' (the weights' dtype) or 'fp8' (float8 e4m3 "
                             "with per-KV-head scales: twice the pages in the same memory)")
    parser.add_argument("--num-pages", type=int, default=None,
                        help="KV cache pages (default: what fits in the device's memory)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="sequences per step (default: 32 on CPU; on a GPU as many as "
                             "the KV pool holds at 256 tokens each, up to 1024)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per step, prefill chunks plus decodes (default: 512 on "
                             "CPU, 8192 on a GPU)")
    parser.add_argument("--token-buckets", type=_ints, default=None,
                        help="comma-separated token-axis sizes to compile (default: the engine's)")
    parser.add_argument("--page-buckets", type=_ints, default=None,
                        help="comma-separated page-table widths to compile (default: the engine's)")
    parser.add_argument("--max-queue", type=int, default=1024,
                        help="requests waiting for their first token before new ones get "
                             "RESOURCE_EXHAUSTED")
    parser.add_argument("--grace-period", type=float, default=30.0,
                        help="seconds in-flight requests get to finish on SIGTERM")
    parser.add_argument("--log-level", default="INFO")
    from .speculative import add_argument as add_speculative_argument
    add_speculative_argument(parser)
    try:
        from ..sharding.mesh import add_mesh_arguments
    except ImportError:  # no mesh options in this build: one device
        return
    add_mesh_arguments(parser)


def add_quantization_argument(parser):
    from ..model.quant import QUANTIZATIONS
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="store the linear weights quantized as they load: fp8 = "
                             "float8_e4m3fn with per-output-channel scales (default: as loaded)")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def llm_factory(args):
    """A function that builds the LLM that `args` ask for (run on the loading thread)."""
    def make():
        import jax.numpy as jnp
        from .llm import LLM
        kwargs = dict(max_model_len=args.max_model_len, num_pages=args.num_pages,
                      page_size=args.page_size, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      quantization=getattr(args, "quantization", None),
                      kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                      pace=None)  # online: first come first served, the whole budget a step
        if getattr(args, "speculative_config", None) is not None:
            kwargs["speculative_config"] = args.speculative_config
        if getattr(args, "batch_invariant", False):
            kwargs["batch_invariant"] = True
        for name in ("token_buckets", "page_buckets"):
            if getattr(args, name):
                kwargs[name] = getattr(args, name)
        if getattr(args, "mesh", None):
            from ..sharding.mesh import mesh_from_args
            mesh = mesh_from_args(args)
            if mesh.devices.size > 1:  # one device needs no mesh
                kwargs["mesh"] = mesh
        if args.random_weights:
            return random_llm(args.model, args.dtype, kwargs)
        if args.dtype:
            kwargs["dtype"] = getattr(jnp, args.dtype)
        return LLM(args.model, **kwargs)
    return make


def random_llm(folder, dtype: str | None, kwargs):
    """An LLM of random weights for the model that `folder`'s config.json describes."""
    import jax
    import jax.numpy as jnp
    from ..model import init_params, load_config
    from .llm import LLM
    if folder is None:
        raise ValueError("--random-weights needs --model, a folder with a config.json")
    from ..model.hub import resolve
    config = load_config(resolve(folder))
    dtype = getattr(jnp, dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32"))
    params = jax.jit(lambda: init_params(config, 0, dtype))()  # made on the device
    return LLM.from_params(config, params, None, **kwargs)


def served_name(model) -> str:
    """A Hub name is reported as given (`org/name`); a folder by its name."""
    from ..model.hub import is_repo_id
    if model is None:
        return "default"
    return model.partition("@")[0] if is_repo_id(model) and not Path(model).exists() \
        else Path(model).name


def setup_logging(level: str):
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    requests = logging.getLogger("pallasite.serving.requests")  # bare JSON lines
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    requests.addHandler(handler)
    requests.propagate = False


async def serve(args) -> int:
    grpc_port = args.port if args.port is not None or args.http_port is not None else 50051
    server = Server(host=args.host, port=grpc_port, http_port=args.http_port,
                    metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                    max_queue=args.max_queue, grace_s=args.grace_period)
    port = await server.start()
    where = [f"listening on {args.host}:{port}"] if port is not None else []
    if server.http_port is not None:
        where.append(f"OpenAI HTTP on http://{args.host}:{server.http_port}/v1" if where else
                     f"listening on http://{args.host}:{server.http_port}/v1 (OpenAI HTTP)")
    if server.metrics_port is not None:
        where.append(f"metrics on http://{args.host}:{server.metrics_port}/metrics")
    print(f"pallasite: {', '.join(where)}; loading the model", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    name = args.served_model_name or served_name(args.model)
    loading = asyncio.create_task(server.load(llm_factory(args), name))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([loading, stopping], return_when=asyncio.FIRST_COMPLETED)
    if loading.done() and loading.exception() is not None:
        print(f"pallasite: cannot serve the model: {loading.exception()}", file=sys.stderr)
        await server.drain(0)
        return 1
    if loading.done():
        print("pallasite: ready (health SERVING)", flush=True)
        await stopping
    print(f"pallasite: draining (grace period {args.grace_period:g} s)", flush=True)
    await server.drain()
    if server.service.llm is not None:
        server.service.llm.close()
    return 0


def run(args) -> int:
    """Serve until SIGTERM or SIGINT; returns the exit code (0 after a drain)."""
    if getattr(args, "speculative_config", None) is not None and not args.random_weights:
        from .llm import default_model_folder
        from .speculative import check_cli
        check_cli("pallasite serve", args.speculative_config,
                          args.model or default_model_folder())
    setup_logging(args.log_level)
    code = asyncio.run(serve(args))
    if any(t.name == "pallasite-load" and t.is_alive() for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # stopped during warm-up: do not tear JAX down under a compilation
    return code


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(prog="pallasite serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
