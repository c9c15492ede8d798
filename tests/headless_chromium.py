"""A page in headless Chromium, driven over the DevTools protocol on a pipe (no network port, no extra package).

Chromium started with `--remote-debugging-pipe` reads protocol commands from file descriptor 3 and writes
replies and events to file descriptor 4, one JSON message per NUL-terminated chunk. `Page` opens one tab
(flattened session), loads a URL, records every console message, uncaught exception and browser log entry,
evaluates JavaScript, moves the mouse and takes screenshots.
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
TIMEOUT = 60.0  # seconds for one protocol reply (a cold start on a loaded CI machine)


def find_browser() -> Optional[str]:
    """$PTQ_CHROMIUM, or the first Chromium-family browser on PATH."""
    named = os.environ.get("PTQ_CHROMIUM")
    if named:
        return named
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


@dataclass(frozen=True)
class ConsoleMessage:
    level: str  # "error" for console.error/assert, uncaught exceptions and browser errors; else the level
    source: str  # "console", "exception" or "log"
    text: str


class Page:
    """One headless Chromium with one tab. Use as a context manager; `messages` collects what the page logs."""

    def __init__(self, browser: str, width: int = 1280, height: int = 900):
        self.messages: list[ConsoleMessage] = []
        self._replies: "queue.Queue[dict]" = queue.Queue()
        self._events: "queue.Queue[dict]" = queue.Queue()
        self._next_id = 0
        self._session: Optional[str] = None
        self._loaded = False
        self._profile = tempfile.TemporaryDirectory(prefix="ptq-chromium-")
        self._stderr = open(Path(self._profile.name) / "stderr.txt", "wb")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # above 10 and close-on-exec, so that the child's descriptors 3 and 4 are the only copies it keeps
        child_in = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD_CLOEXEC, 10)
        child_out = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(to_browser_r)
        os.close(from_browser_w)

        def descriptors_3_and_4():  # runs in the child between fork and exec
            os.dup2(child_in, 3)
            os.dup2(child_out, 4)

        args = [browser, "--headless", "--remote-debugging-pipe", "--no-first-run", "--no-default-browser-check",
                "--disable-gpu", "--disable-extensions", "--mute-audio", "--hide-scrollbars",
                f"--user-data-dir={self._profile.name}", f"--window-size={width},{height}", "about:blank"]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to run its sandbox as root
        try:
            self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._stderr, stderr=self._stderr,
                                            close_fds=False, preexec_fn=descriptors_3_and_4)
        finally:
            os.close(child_in)
            os.close(child_out)
        threading.Thread(target=self._read, daemon=True).start()
        target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self._call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")

    def __enter__(self) -> "Page":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self._call("Browser.close", timeout=10)
            except (TimeoutError, RuntimeError, OSError):
                pass  # a browser that does not answer is killed below
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._to_browser)
        self._stderr.close()
        self._profile.cleanup()

    # --- the protocol ---

    def _read(self) -> None:
        buffer = b""
        while True:
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                break
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                (self._replies if "id" in message else self._events).put(message)
        os.close(self._from_browser)
        self._replies.put({"id": None, "closed": True})

    def _call(self, method: str, params: Optional[dict] = None, session: Optional[str] = None,
              timeout: float = TIMEOUT) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            try:
                reply = self._replies.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"chromium did not answer {method} within {timeout:.0f} s") from None
            if reply.get("closed"):
                raise RuntimeError(f"chromium closed the pipe during {method}: {self.stderr()[-2000:]}")
            if reply["id"] == self._next_id:
                break
        self._drain_events()
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error'].get('message')}")
        return reply.get("result", {})

    def call(self, method: str, params: Optional[dict] = None) -> dict:
        """A command to the tab."""
        return self._call(method, params, self._session)

    def _drain_events(self) -> list[dict]:
        events = []
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return events
            self._record(event)
            events.append(event)

    def _record(self, event: dict) -> None:
        method, params = event.get("method"), event.get("params", {})
        if method == "Page.loadEventFired" and event.get("sessionId") == self._session:
            self._loaded = True
        elif method == "Runtime.consoleAPICalled":
            level = "error" if params["type"] in ("error", "assert") else params["type"]
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.messages.append(ConsoleMessage(level, "console", text))
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text", "")
            self.messages.append(ConsoleMessage("error", "exception", text))
        elif method == "Log.entryAdded":
            entry = params["entry"]
            self.messages.append(ConsoleMessage(entry["level"], "log", entry.get("text", "")))

    # --- what a test does with the page ---

    def load(self, url: str, timeout: float = TIMEOUT) -> None:
        """Navigate and wait for the load event (scripts have run); `messages` then holds this page's only."""
        self._drain_events()
        self.messages.clear()
        self._loaded = False
        self.call("Page.navigate", {"url": url})
        while not self._loaded:
            try:
                self._record(self._events.get(timeout=timeout))
            except queue.Empty:
                raise TimeoutError(f"{url} did not load within {timeout:.0f} s") from None
        self.evaluate("0")  # one more round trip: messages logged during load arrive before its reply

    def evaluate(self, expression: str):
        """The value of a JavaScript expression (JSON-serializable); a thrown error raises RuntimeError."""
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def hover(self, x: float, y: float) -> None:
        """Move the mouse to (x, y) in CSS pixels of the viewport."""
        self.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})

    def screenshot(self, path: Path) -> Path:
        """The whole page (not only the viewport) as a PNG."""
        size = self.call("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        data = self.call("Page.captureScreenshot", {"format": "png", "clip": clip, "captureBeyondViewport": True})
        path = Path(path)
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    def errors(self) -> list[ConsoleMessage]:
        self._drain_events()
        return [m for m in self.messages if m.level == "error"]

    def stderr(self) -> str:
        self._stderr.flush()
        return (Path(self._profile.name) / "stderr.txt").read_text(errors="replace")
