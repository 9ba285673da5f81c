"""Headless Chromium driven over the Chrome DevTools protocol: open a page, wait for text, click a
tab, take a screenshot. Enough to check what the Prefect UI shows, with no browser library."""

from __future__ import annotations

import base64
import json
import subprocess
import time
import urllib.request
from pathlib import Path

from websockets.sync.client import connect

from infra.process import free_port

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1300",
]


class Browser:
    def __init__(self, chromium: Path, profile: Path):
        port = free_port()
        self.proc = subprocess.Popen(
            [
                str(chromium),
                *FLAGS,
                f"--user-data-dir={profile}",
                "--remote-debugging-address=127.0.0.1",
                f"--remote-debugging-port={port}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as resp:
                    pages = [t for t in json.loads(resp.read()) if t["type"] == "page"]
                if pages:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("Chromium's DevTools endpoint did not answer within 30 s")
            time.sleep(0.3)
        self.ws = connect(pages[0]["webSocketDebuggerUrl"], max_size=None)
        self._id = 0

    def send(self, method: str, **params) -> dict:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def evaluate(self, expression: str):
        return self.send("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def open(self, url: str) -> None:
        self.send("Page.navigate", url=url)

    def text(self) -> str:
        return self.evaluate("document.body ? document.body.innerText : ''") or ""

    def html(self) -> str:
        return self.evaluate("document.documentElement.outerHTML") or ""

    def wait_for(self, *needles: str, timeout_s: float = 45.0) -> str:
        """The page's text once it contains every needle; fails with what it does show."""
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.text()
            if all(n in text for n in needles):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"page never showed {needles}; it shows:\n{text[-3000:]}")
            time.sleep(0.5)

    def click_text(self, label: str) -> None:
        """Click the element holding the text `label` (a tab, a button)."""
        found = self.evaluate(
            "(() => { const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);"
            f" while (walk.nextNode()) {{ if (walk.currentNode.nodeValue.trim() === {json.dumps(label)}) {{"
            " walk.currentNode.parentElement.click(); return true; } } return false; })()"
        )
        if not found:
            raise AssertionError(f"nothing labelled {label!r} to click; the page shows:\n{self.text()[-2000:]}")

    def screenshot(self, path: Path) -> Path:
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
