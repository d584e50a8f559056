"""Session fixtures: a tiny synthetic DeepSeek-V4 checkpoint (random weights, the real
tokenizer), two real `pdserve-router` processes on loopback serving it (one without and one
with an API key), the official clients pointed at them, and DeepSeek's official Python encoder
configured as the router configures its Rust twin.

The binaries come from $PYTEST_PDSERVE_BIN_DIR (scripts/python-tests sets it), else
$CARGO_TARGET_DIR/debug, else target/debug. Every wait is bounded; only 127.0.0.1 is used.
"""

from __future__ import annotations

import copy
import ctypes
import http.client
import json
import os
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import deepseek_recipe as dr
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVED_NAME = "deepseek-v4-flash"
API_KEY = "pytest-secret-key"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
REQUEST_TIMEOUT_S = 60.0


def bin_dir() -> Path:
    explicit = os.environ.get("PYTEST_PDSERVE_BIN_DIR")
    if explicit:
        return Path(explicit)
    target = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
    if not target.is_absolute():
        target = ROOT / target
    return target / "debug"


def binary(name: str) -> Path:
    path = bin_dir() / name
    if not path.is_file():
        pytest.exit(f"{path} not built: run scripts/python-tests (it builds the binaries)", 2)
    return path


def child_env() -> dict[str, str]:
    """The environment of a spawned binary: no inherited `PDSERVE_*` settings (they would
    change what is tested, and unknown ones are refused), quiet logs."""
    keep = {"PDSERVE_CACHE_DIR"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_") or k in keep}
    env["PDSERVE_LOG"] = "warn"
    return env


def _die_with_parent() -> None:
    # Linux PR_SET_PDEATHSIG: the router gets SIGTERM if pytest dies without cleaning up.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


# --- plain HTTP on loopback (for what the clients cannot send: malformed JSON, no key) -------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http_request(
    addr: tuple[str, int],
    method: str,
    path: str,
    body: bytes | str | dict | list | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = REQUEST_TIMEOUT_S,
) -> Reply:
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode()
    all_headers = {"Connection": "close"}
    if body is not None:
        all_headers["Content-Type"] = "application/json"
    all_headers.update(headers or {})
    conn = http.client.HTTPConnection(addr[0], addr[1], timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=all_headers)
        resp = conn.getresponse()
        data = resp.read()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)
    finally:
        conn.close()


# --- the router process ------------------------------------------------------------------------


class ServiceProcess:
    """A running pdserve binary (`program`) that announced its role and bound addresses on its
    readiness line (`PDSERVE_READY role=<role> <name>=<addr> ...`, common/src/cli.rs)."""

    role = ""

    def __init__(self, program: str, args: list[str]) -> None:
        cmd = [str(binary(program)), *args]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env(),
            preexec_fn=_die_with_parent,
        )
        self.stderr_tail: deque[str] = deque(maxlen=200)
        self._ready_line: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        try:
            self.addrs = self._wait_announced()
        except BaseException:
            self.stop()
            raise

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            if line.startswith("PDSERVE_READY ") and self._ready_line is None:
                self._ready_line = line
                self._ready.set()
        self._ready.set()  # EOF: the process exited

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            self.stderr_tail.append(raw.decode(errors="replace").rstrip())

    def diagnostics(self) -> str:
        return "\n".join(self.stderr_tail)

    def _wait_announced(self) -> dict[str, str]:
        if not self._ready.wait(START_TIMEOUT_S) or self._ready_line is None:
            raise RuntimeError(
                f"{self.role} printed no readiness line (exit {self.proc.poll()}):\n{self.diagnostics()}"
            )
        fields = dict(kv.split("=", 1) for kv in self._ready_line.split()[1:] if "=" in kv)
        assert fields.get("role") == self.role, self._ready_line
        return fields

    def stop(self) -> int | None:
        """SIGTERM, then the exit status (bounded; SIGKILL after STOP_TIMEOUT_S)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
                return None
        return self.proc.returncode


class WorkerProcess(ServiceProcess):
    """A running prefill or decode worker on an ephemeral loopback port."""

    def __init__(self, role: str, model_dir: Path) -> None:
        self.role = role
        super().__init__(
            f"pdserve-{role}", ["--grpc-listen", "127.0.0.1:0", "--model-dir", str(model_dir)]
        )
        self.grpc = self.addrs["grpc"]


class RouterProcess(ServiceProcess):
    """A running `pdserve-router`; `http` is its bound HTTP address."""

    role = "router"

    def __init__(self, args: list[str]) -> None:
        super().__init__(
            "pdserve-router",
            ["--http-listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0", *args],
        )
        try:
            self.http = self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> tuple[str, int]:
        deadline = time.monotonic() + START_TIMEOUT_S
        host, port = self.addrs["http"].rsplit(":", 1)
        assert host == "127.0.0.1", self.addrs
        addr = (host, int(port))
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited ({self.proc.returncode}):\n{self.diagnostics()}")
            try:
                r = http_request(addr, "GET", "/health/ready", timeout=5)
                if r.status == 200:
                    return addr
                last = f"{r.status} {r.body[:300]!r}"
            except OSError as e:
                last = repr(e)
            time.sleep(0.1)
        raise RuntimeError(f"router not ready within {START_TIMEOUT_S} s ({last}):\n{self.diagnostics()}")

    @property
    def url(self) -> str:
        return f"http://{self.http[0]}:{self.http[1]}"

    def get(self, path: str, **kw: Any) -> Reply:
        return http_request(self.http, "GET", path, **kw)

    def post(self, path: str, body: Any, **kw: Any) -> Reply:
        return http_request(self.http, "POST", path, body, **kw)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pdctl gen-model --preset tiny --seed 1 --experts mxfp4` (copies the setup cache's
    tokenizer.json)."""
    out = tmp_path_factory.mktemp("model") / "tiny-mxfp4-seed1"
    cmd = [
        str(binary("pdctl")),
        "gen-model",
        "--preset",
        "tiny",
        "--seed",
        "1",
        "--experts",
        "mxfp4",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"pdctl gen-model failed:\n{done.stderr}"
    if not (out / "tokenizer.json").is_file():
        pytest.exit("the generated checkpoint has no tokenizer.json: run scripts/setup", 2)
    return out


def _start(args: list[str]):
    router = RouterProcess(args)
    yield router
    code = router.stop()
    assert code == 0, f"router did not exit cleanly after SIGTERM ({code}):\n{router.diagnostics()}"


def disaggregated() -> bool:
    """`PYTEST_PDSERVE_LAYOUT=pd`: the clients talk to a router over one prefill and one
    decode worker (state moving between them over TCP) instead of its in-process engine."""
    layout = os.environ.get("PYTEST_PDSERVE_LAYOUT", "local")
    assert layout in ("local", "pd"), f"PYTEST_PDSERVE_LAYOUT={layout}: local or pd"
    return layout == "pd"


@pytest.fixture(scope="session")
def router(model_dir: Path):
    args = ["--model-dir", str(model_dir), "--served-model-name", SERVED_NAME]
    if not disaggregated():
        yield from _start(args)
        return
    workers = []
    try:
        for role in ("prefill", "decode"):
            workers.append(WorkerProcess(role, model_dir))
        prefill, decode = workers
        yield from _start([*args, "--prefill-worker", prefill.grpc, "--decode-worker", decode.grpc])
    finally:
        for w in reversed(workers):
            code = w.stop()
            assert code == 0, f"{w.role} worker did not exit cleanly ({code}):\n{w.diagnostics()}"


@pytest.fixture(scope="session")
def keyed_router(model_dir: Path):
    yield from _start(
        ["--model-dir", str(model_dir), "--served-model-name", SERVED_NAME, "--api-key", API_KEY]
    )


# Closed before the router stops, so no kept-alive connection holds up its graceful exit.
@pytest.fixture(scope="session")
def client(router: RouterProcess):
    c = openai.OpenAI(
        base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )
    yield c
    c.close()


@pytest.fixture(scope="session")
def anthropic_client(router: RouterProcess):
    c = anthropic.Anthropic(
        base_url=router.url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )
    yield c
    c.close()


@pytest.fixture(scope="session")
def max_model_len(router: RouterProcess) -> int:
    r = router.get("/v1/models")
    assert r.status == 200, r.body
    return int(r.json()["data"][0]["max_model_len"])


# --- the official Python encoder, configured as router/src/served.rs configures its own -------


class Official:
    """DeepSeek's official converter and V4 encoder (`deepseek-recipe` from PyPI) with the
    router's options: every accepted model name rendered as V4 (`DeepseekV4Pro`), thinking on
    by default (the router's `thinking_default`)."""

    def __init__(self, tokenizer_json: Path, names: list[str]) -> None:
        self.tokenizer = dr.Tokenizer.from_file(str(tokenizer_json))
        self.encoding = dr.DeepseekV4Encoding().with_tokenizer(self.tokenizer)
        self.names = names

    def options(self) -> dr.ConversionOptions:
        return (
            dr.ConversionOptions()
            .with_model_versions_by_name({n: dr.ModelVersion.DeepseekV4Pro for n in self.names})
            .with_default_thinking_mode(True)
        )

    def conversation(self, kind: str, body: dict[str, Any]) -> dr.Conversation:
        request = {
            "chat": dr.ChatCompletionRequest,
            "messages": dr.MessagesRequest,
            "responses": dr.ResponsesRequest,
        }[kind](copy.deepcopy(body))
        return request.convert(self.options()).conversation

    def chat_ids(self, body: dict[str, Any]) -> list[int]:
        return self.encoding.encode(self.conversation("chat", body))

    def chat_prompt(self, body: dict[str, Any]) -> str:
        return self.encoding.render_conversation(self.conversation("chat", body)).prompt

    def ids(self, kind: str, body: dict[str, Any]) -> list[int]:
        return self.encoding.encode(self.conversation(kind, body))


@pytest.fixture(scope="session")
def official(router: RouterProcess, model_dir: Path) -> Official:
    r = router.get("/v1/models")
    assert r.status == 200, r.body
    names = [m["id"] for m in r.json()["data"]]
    assert SERVED_NAME in names
    return Official(model_dir / "tokenizer.json", names)
