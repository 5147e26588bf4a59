"""Running the app under uvicorn: in the foreground (``moetrain serve``) or in a background thread (tests,
benchmarks), on a given port or on port 0 (the OS picks one; the bound port is read back from the socket)."""

from __future__ import annotations

import threading
import time


class BackgroundServer:
    """uvicorn serving ``app`` in a daemon thread; ``url`` is ``http://host:port`` once :meth:`start` returns.

    Raises (from start):
        RuntimeError: the server did not start within ``timeout`` seconds.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                     timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name="moetrain-uvicorn", daemon=True)
        self.url = ""

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
