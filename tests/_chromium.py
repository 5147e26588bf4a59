"""Open a page in headless Chromium and collect its console errors, through the DevTools protocol over a pipe
(``--remote-debugging-pipe``: NUL-separated JSON on file descriptors 3 and 4), with the standard library only.

Errors collected: ``console.error`` / ``console.assert`` calls, uncaught exceptions, and browser log entries of level
``error`` (which include failed resource loads such as a missing image).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from typing import Any

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--remote-debugging-pipe"]


def find_chromium() -> str | None:
    """Path of a Chromium / Chrome binary, or ``None``."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _describe(event: dict[str, Any]) -> str | None:
    method, p = event.get("method"), event.get("params", {})
    if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
        args = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
        return f"console.{p['type']}: {args}"
    if method == "Runtime.exceptionThrown":
        details = p.get("exceptionDetails", {})
        return "exception: " + details.get("exception", {}).get("description", details.get("text", ""))
    if method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
        return f"log: {p['entry'].get('text', '')} {p['entry'].get('url', '')}".strip()
    return None


def page_errors(chrome: str, url: str, expression: str | None = None,
                timeout: float = 60.0) -> tuple[list[str], Any]:
    """Load ``url`` and return (console errors, value of the JavaScript ``expression`` evaluated after the load
    event, or ``None``)."""
    cmd_r, cmd_w = os.pipe()  # we write commands; Chromium reads fd 3
    out_r, out_w = os.pipe()  # Chromium writes fd 4; we read

    def child() -> None:
        a, b = os.dup(cmd_r), os.dup(out_w)  # above 4, so dup2 cannot clobber one with the other
        os.dup2(a, 3)
        os.dup2(b, 4)

    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.Popen([chrome, *FLAGS, f"--user-data-dir={profile}", "about:blank"], preexec_fn=child,
                                pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(out_w)
        deadline = time.monotonic() + timeout
        state = {"buf": b"", "id": 0}
        errors: list[str] = []

        def events(until: float):
            while time.monotonic() < min(until, deadline):
                if b"\0" in state["buf"]:
                    raw, _, state["buf"] = state["buf"].partition(b"\0")
                    event = json.loads(raw)
                    error = _describe(event)
                    if error:
                        errors.append(error)
                    yield event
                    continue
                if select.select([out_r], [], [], 0.1)[0]:
                    chunk = os.read(out_r, 1 << 20)
                    if not chunk:
                        return
                    state["buf"] += chunk

        def send(method: str, params: dict | None = None, session: str | None = None) -> int:
            state["id"] += 1
            msg: dict[str, Any] = {"id": state["id"], "method": method, "params": params or {}}
            if session:
                msg["sessionId"] = session
            os.write(cmd_w, json.dumps(msg).encode() + b"\0")
            return state["id"]

        def call(method: str, params: dict | None = None, session: str | None = None) -> dict:
            wanted = send(method, params, session)
            for event in events(deadline):
                if event.get("id") == wanted:
                    if "error" in event:
                        raise RuntimeError(f"{method}: {event['error']}")
                    return event.get("result", {})
            raise TimeoutError(f"Chromium did not answer {method}")

        try:
            target = call("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Runtime", "Log", "Page"):
                call(f"{domain}.enable", session=session)
            call("Page.navigate", {"url": url}, session=session)
            if not any(e.get("method") == "Page.loadEventFired" for e in events(deadline)):
                raise TimeoutError(f"{url} did not finish loading")
            list(events(time.monotonic() + 1.0))  # late console messages
            value = None
            if expression is not None:
                value = call("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                             session=session).get("result", {}).get("value")
            send("Browser.close")
        finally:
            os.close(cmd_w)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            os.close(out_r)
    return errors, value
