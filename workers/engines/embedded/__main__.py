"""`python -m workers.engines.embedded`: serve one model over SGLang's HTTP API."""

from __future__ import annotations

import argparse
import logging
import os

import torch
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from workers.engines import ENGINE_KEEPALIVE_S
from workers.engines.embedded.runner import ModelRunner
from workers.engines.embedded.server import LOG, EmbeddedEngine
from workers.gc_freeze import setup_objects_frozen
from workers.procs import exit_now


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Embedded engine speaking SGLang's native HTTP API")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0: all cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


class OneLineForUnparsableRequests(logging.Filter):
    """aiohttp logs a request it cannot parse as an ERROR with a traceback. sglang-router sends each engine
    two at start (HTTP/2 probes), which SGLang's uvicorn logs as one warning line: do the same, so that
    an error in this log is a real one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], BadHttpMessage):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args, record.exc_info, record.exc_text = "Invalid HTTP request received.", (), None, None
        return True


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        force=True)
    logging.getLogger("aiohttp.server").addFilter(OneLineForUnparsableRequests())
    torch.set_num_threads(args.num_threads or os.cpu_count() or 1)
    runner = ModelRunner(args.model_path, args.device, getattr(torch, args.dtype), args.seed)
    engine = EmbeddedEngine(runner, max_batch_size=args.max_batch_size)
    LOG.info("serving %s on http://%s:%d (%s, %s)", args.model_path, args.host, args.port, args.device, args.dtype)
    # One access line per request, in uvicorn's shape ('"POST /path HTTP/1.1" 200'), as SGLang's log
    # has: the two engines' logs are records of the same calls, which the tests compare.
    with setup_objects_frozen():  # the model and torch's modules: no full collection between decode steps walks them
        web.run_app(engine.build_app(), host=args.host, port=args.port, access_log=logging.getLogger("aiohttp.access"),
                    access_log_format='%a "%r" %s', print=None, shutdown_timeout=1.0,
                    keepalive_timeout=ENGINE_KEEPALIVE_S)
    # Stopped (SIGTERM: aiohttp closed its connections and the app): the job waits for this process,
    # so skip Python's slow teardown of torch and the model (workers.procs.exit_now).
    exit_now(0)


if __name__ == "__main__":
    main()
