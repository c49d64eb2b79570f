"""The real `nm-gateway` binary (from `NM_GATEWAY_BIN`) as a test fixture.

`serve` (all in one) or split (`controlplane` + `dataplane`, for stopping the controlplane),
on ports the processes pick themselves (`127.0.0.1:0`; the addresses are read from their
"listening on" log lines), a temporary SQLite database and spool, every provider's upstream
pointed at one mock, and an admin key of generated strength chosen here. What the gateway
recorded is read back through its own CLI (`usage`, `agents show`), polling with a deadline:
records reach the controlplane in batches.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Dict, List, Optional, TypeVar

T = TypeVar("T")

PROVIDERS = (
    "openai",
    "anthropic",
    "gemini",
    "groq",
    "mistral",
    "deepseek",
    "xai",
    "together",
    "fireworks",
    "openrouter",
)
OPERATOR_OPENAI_KEY = "sk-operator-openai"
DEADLINE_SECS = 30.0


def binary() -> str:
    path = os.environ.get("NM_GATEWAY_BIN")
    if not path:
        raise RuntimeError(
            "NM_GATEWAY_BIN is not set: point it at the nm-gateway binary "
            "(cargo build --bin nm-gateway; NM_GATEWAY_BIN=target/debug/nm-gateway)"
        )
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"NM_GATEWAY_BIN={path} is not an executable file")
    return os.path.abspath(path)


def eventually(what: str, fn: Callable[[], Optional[T]], deadline: float = DEADLINE_SECS) -> T:
    """Polls `fn` until it returns something other than None, for at most `deadline` s."""
    end = time.monotonic() + deadline
    pause = 0.02
    last_error: Optional[BaseException] = None
    while True:
        try:
            got = fn()
            if got is not None:
                return got
        except AssertionError as e:  # the condition's own detail, for the timeout message
            last_error = e
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline}s waiting for {what}: {last_error or ''}")
        time.sleep(pause)
        pause = min(pause * 2, 0.25)


class Process:
    """A spawned binary whose output is collected line by line."""

    def __init__(self, args: List[str], env: Dict[str, str], name: str) -> None:
        self.name = name
        self.lines: List[str] = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(
            [binary(), *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            encoding="utf-8",
            errors="replace",
        )
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for_line(self, pattern: str, deadline: float = 60.0) -> re.Match[str]:
        rx = re.compile(pattern)
        end = time.monotonic() + deadline
        with self._cond:
            while True:
                for line in self.lines:
                    m = rx.search(line)
                    if m:
                        return m
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n" + self.output())
                left = end - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{self.name}: no line matching {pattern!r}:\n" + self.output())
                self._cond.wait(left)

    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines[-60:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _listening(p: Process, what: str) -> str:
    return p.wait_for_line(what + r" listening on (\S+?)[\s\",]").group(1)


class RealGateway:
    """`nm-gateway serve`, or a split controlplane + dataplane, on a temp dir."""

    def __init__(self, tmpdir: str, upstream: str, *, split: bool = False) -> None:
        self.tmpdir = tmpdir
        self.split = split
        self.admin_key = "nmk_" + secrets.token_hex(24)
        self.link_secret = secrets.token_hex(24)
        base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
        base.update(
            {
                "NM_DATABASE_URL": f"sqlite://{tmpdir}/nm.db?mode=rwc",
                "NM_SPOOL_DIR": f"{tmpdir}/spool",
                "NM_BOOTSTRAP_KEY": self.admin_key,
                "NM_HTTP_ADDR": "127.0.0.1:0",
                "NM_GRPC_ADDR": "127.0.0.1:0",
                "NM_ANALYTICS_INTERVAL_SECS": "0",
                "NM_SHUTDOWN_GRACE_SECS": "2",
                "NM_LOG": "info",
                "NM_PROVIDER_KEY_OPENAI": OPERATOR_OPENAI_KEY,
            }
        )
        for p in PROVIDERS:
            base[f"NM_UPSTREAM_{p.upper()}"] = upstream
        if split:
            base["NM_LINK_SECRET"] = self.link_secret
        self.env = base
        self.controlplane: Optional[Process] = None
        self.dataplane: Optional[Process] = None
        if split:
            self.controlplane = Process(["controlplane"], dict(base), "controlplane")
            self.grpc_addr = _listening(self.controlplane, "controlplane gRPC")
            dp_env = dict(base, NM_CONTROLPLANE_URL=f"http://{self.grpc_addr}")
            self.dataplane = Process(["dataplane"], dp_env, "dataplane")
            self.http_addr = _listening(self.dataplane, "dataplane HTTP")
        else:
            self.dataplane = Process(["serve"], dict(base), "serve")
            self.grpc_addr = _listening(self.dataplane, "controlplane gRPC")
            self.http_addr = _listening(self.dataplane, "dataplane HTTP")
        self.url = f"http://{self.http_addr}"
        self.wait_healthy()

    def health(self) -> int:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except OSError:
            return 0

    def wait_healthy(self) -> None:
        eventually("/health = 200", lambda: True if self.health() == 200 else None, 60)

    def stop_controlplane(self) -> None:
        assert self.split and self.controlplane is not None
        self.controlplane.stop()

    def start_controlplane(self) -> None:
        assert self.split
        env = dict(self.env, NM_GRPC_ADDR=self.grpc_addr)
        self.controlplane = Process(["controlplane"], env, "controlplane (restarted)")
        _listening(self.controlplane, "controlplane gRPC")

    def stop_serve(self) -> None:
        """`serve` only: the whole gateway goes away (clients get connection errors)."""
        assert not self.split and self.dataplane is not None
        self.dataplane.stop()

    def start_serve(self) -> None:
        """`serve` only: the gateway comes back on the same addresses and database."""
        assert not self.split
        env = dict(self.env, NM_HTTP_ADDR=self.http_addr, NM_GRPC_ADDR=self.grpc_addr)
        self.dataplane = Process(["serve"], env, "serve (restarted)")
        _listening(self.dataplane, "dataplane HTTP")

    def stop(self) -> None:
        for p in (self.dataplane, self.controlplane):
            if p is not None:
                p.stop()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.output()}" for p in (self.controlplane, self.dataplane) if p is not None
        )

    # === what the gateway recorded, through its CLI ===

    def cli(self, *args: str) -> Any:
        env = dict(self.env, NM_CONTROLPLANE_URL=f"http://{self.grpc_addr}", NM_ADMIN_KEY=self.admin_key)
        done = subprocess.run(
            [binary(), *args, "--json"],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            raise AssertionError(f"nm-gateway {' '.join(args)} exited {done.returncode}: {done.stderr}")
        return json.loads(done.stdout)

    def usage(self, *by: str, **filters: str) -> List[Dict[str, Any]]:
        args = ["usage", "--by", ",".join(by), "--limit", "10000"]
        for k, v in filters.items():
            args += [f"--{k}", v]
        rows: List[Dict[str, Any]] = self.cli(*args)["rows"]
        return rows

    def agent_signals(self, agent: str) -> Dict[str, Any]:
        out: Dict[str, Any] = self.cli("agents", "show", agent)
        return out

    def metric(self, name: str) -> Optional[float]:
        """A plain (label-free) value from the dataplane's /metrics."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[0] == name:
                    return float(parts[1])
        return None

    def create_key(self, name: str) -> str:
        secret: str = self.cli("keys", "create", "--name", name)["secret"]
        return secret
