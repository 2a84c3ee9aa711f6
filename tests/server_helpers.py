"""Running the OpenAI-compatible server inside a test: uvicorn in a thread on a free loopback
port (the socket is bound before the thread starts, so no other process can take it)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from tinyvllm.engine.engine import Engine


def served_state(argv: list[str]) -> Any:
    """The ServerState `tinyvllm serve ARGV --device cpu` would serve, through the command's
    own flag parsing, checks and model resolution; the caller shuts `state.engine` down."""
    from tinyvllm.cli import build_parser, serve_setup
    from tinyvllm.server.cli import load_server_state

    args = build_parser().parse_args(["serve", *argv, "--device", "cpu"])
    return load_server_state(args, *serve_setup(args))


class ServerThread:
    """`with ServerThread(app) as server:` serves `app` at `server.url` until the block ends."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def wait_engine_clean(engine: Engine, timeout: float = 10.0) -> None:
    """Wait until no request is left and every KV block is free; AssertionError otherwise."""
    pool = engine.kv_cache_manager.pool
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            not engine.has_unfinished_requests()
            and not engine.scheduler.has_unfinished_requests()
            and pool.num_free_blocks == pool.num_blocks
        ):
            return
        time.sleep(0.02)
    raise AssertionError(
        f"engine not clean after {timeout} s: {engine.get_num_unfinished_requests()} request(s), "
        f"{pool.num_blocks - pool.num_free_blocks} block(s) in use"
    )
