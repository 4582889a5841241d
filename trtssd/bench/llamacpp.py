"""llama.cpp's own server as a peer: find the built ``llama-server``, start it, talk to it, stop it.

``scripts/setup_llamacpp.sh tools`` builds the executables from the llama.cpp tree vendored in the
llama-cpp-python sdist (the same build as the libraries llama-cpp-python loads) into
``~/.cache/trtssd/llama.cpp/<version>-<machine>-<cpu key>/bin``; ``ensure_llama_server`` runs it
when a benchmark or a test first needs the server.

    with LlamaServer(ServerOptions(model=Path("target.gguf"), draft=Path("draft.gguf"))) as server:
        reply = server.completion({"prompt": [1, 2, 3], "n_predict": 8, "temperature": 0})

The server always runs with ``--no-repack``: repacked weights take a different matmul path for
some batch shapes, so a row's logits would depend on its batch, and greedy sd would no longer
equal plain decoding. The process is ended on leaving the ``with`` block, also on an error inside
it (terminate, then kill), so no server outlives its benchmark.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtssd.processes import ProcessTree

log = logging.getLogger(__name__)

LLAMACPP_VERSION = "0.3.36"  # llama-cpp-python's version; keys the build folder (scripts/setup_llamacpp.sh)
SETUP_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "setup_llamacpp.sh"


class LlamaServerError(RuntimeError):
    """llama-server is missing, did not start, or answered with an error."""


def cpu_key(cpuinfo: str | None = None) -> str:
    """12 hex digits naming this CPU's instruction-set flags: the build compiles for the CPU it
    runs on (GGML_NATIVE), so a cache shared by machines keeps one build per flag set.

    The same rule as ``cpu_key`` in scripts/setup_llamacpp.sh: the first ``flags`` line of
    /proc/cpuinfo, its flags sorted (byte order) and joined by single spaces, sha256-hashed.
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    flags = sorted(line.split(":", 1)[1].split()) if ":" in line else []
    return hashlib.sha256(" ".join(flags).encode()).hexdigest()[:12]


def build_dir() -> Path:
    """The cache folder of this version's build on this machine (setup_llamacpp.sh's HOME_DIR)."""
    cache = Path(os.environ.get("TRTSSD_CACHE", Path.home() / ".cache" / "trtssd"))
    return cache / "llama.cpp" / f"{LLAMACPP_VERSION}-{platform.machine()}-{cpu_key()}"


def default_bin_dir() -> Path:
    """Where setup_llamacpp.sh installs llama-server and llama-bench."""
    return build_dir() / "bin"


def find_llama_server() -> Path | None:
    """$TRTSSD_LLAMA_SERVER, else the one setup_llamacpp.sh built, else one on PATH; None if none."""
    given = os.environ.get("TRTSSD_LLAMA_SERVER")
    if given:
        return Path(given)
    built = default_bin_dir() / "llama-server"
    if built.is_file() and os.access(built, os.X_OK):
        return built
    on_path = shutil.which("llama-server")
    return Path(on_path) if on_path else None


def ensure_llama_server(timeout_s: float = 3600.0) -> Path:
    """The llama-server to run, built first by ``setup_llamacpp.sh tools`` if none is found.

    The build reuses the compiled libraries of the set-up, so it compiles only the tools
    (minutes on 2 cores, once per machine). Raises LlamaServerError when it cannot be built.
    """
    found = find_llama_server()
    if found is not None:
        return found
    if not SETUP_SCRIPT.is_file():
        raise LlamaServerError(f"llama-server not found and {SETUP_SCRIPT} is missing to build it")
    log.info("llama-server not found: building it with %s tools", SETUP_SCRIPT)
    done = subprocess.run(["bash", str(SETUP_SCRIPT), "tools"], timeout=timeout_s)
    found = find_llama_server()
    if done.returncode != 0 or found is None:
        raise LlamaServerError(f"building llama-server failed (bash {SETUP_SCRIPT} tools: exit {done.returncode})")
    return found


@dataclass(frozen=True)
class ServerOptions:
    """How one llama-server runs. Flag names are those of the llama.cpp in LLAMACPP_VERSION."""

    model: Path  # target GGUF
    draft: Path | None = None  # draft GGUF: speculative decoding (llama.cpp's draft-simple)
    draft_max: int = 3  # most tokens drafted per round (--spec-draft-n-max)
    threads: int = 1  # decode threads of the target (-t); trtssd's default is one core per rank
    threads_batch: int | None = None  # prefill threads (-tb); None: same as threads
    draft_threads: int | None = None  # the draft's threads (-td); None: same as threads
    parallel: int = 1  # slots (--parallel): requests decoded together
    ctx_per_slot: int = 2048  # context of each slot; -c is this times parallel
    seed: int = 0
    extra_args: tuple[str, ...] = ()  # appended to the command line as they are
    start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("draft_max", "threads", "parallel", "ctx_per_slot"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)!r}")

    def command(self, binary: Path, port: int) -> list[str]:
        cmd = [str(binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(self.threads), "-tb", str(self.threads_batch or self.threads),
               "-c", str(self.ctx_per_slot * self.parallel), "--parallel", str(self.parallel),
               "--no-repack", "--seed", str(self.seed),
               # No web UI, no warm-up run at start (the bench warms up itself), no slot reuse of
               # earlier prompts (prefill is counted as trtssd counts it).
               "--no-webui", "--no-warmup", "--no-cache-prompt"]
        if self.draft is not None:
            draft_threads = str(self.draft_threads or self.threads)
            cmd += ["-md", str(self.draft), "--spec-type", "draft-simple",
                    "--spec-draft-n-max", str(self.draft_max), "--spec-draft-n-min", "0",
                    "-td", draft_threads, "-tbd", draft_threads]
        return cmd + list(self.extra_args)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A llama-server process on 127.0.0.1 and a free port; a context manager."""

    def __init__(self, options: ServerOptions, binary: Path | None = None):
        self.options = options
        self.binary = binary or find_llama_server()
        if self.binary is None:
            raise LlamaServerError("llama-server not found: run scripts/setup_llamacpp.sh (or set TRTSSD_LLAMA_SERVER)")
        self.tree: ProcessTree | None = None
        self.port: int | None = None
        self._log_file = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.tree.process.pid if self.tree is not None else None

    def __enter__(self) -> "LlamaServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        # The port is free when chosen but another process may take it before the server binds;
        # then the server exits at once and the next try takes another port.
        for attempt in range(3):
            self.port = free_port()
            self._log_file = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
            cmd = self.options.command(self.binary, self.port)
            log.info("starting %s", " ".join(cmd))
            self.tree = ProcessTree(cmd, stdout=self._log_file, stderr=subprocess.STDOUT)
            try:
                self._wait_healthy()
                log.info("llama-server pid %d ready at %s", self.pid, self.url)
                return
            except LlamaServerError:
                tail = self.log_tail()
                self.stop()
                if attempt == 2 or "bind" not in tail.lower():
                    raise
                log.warning("llama-server could not bind port %d; trying another", self.port)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.options.start_timeout_s
        while time.monotonic() < deadline:
            if not self.tree.running():
                raise LlamaServerError(f"llama-server exited with {self.tree.process.returncode} while starting:\n"
                                       f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while the model loads
            time.sleep(0.1)
        raise LlamaServerError(f"llama-server not healthy after {self.options.start_timeout_s:.0f} s:\n"
                               f"{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        if self._log_file is None:
            return ""
        try:
            return Path(self._log_file.name).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the process: SIGTERM (it finishes its slots and exits), then SIGKILL."""
        tree, self.tree = self.tree, None
        if tree is not None:
            tree.stop(timeout_s)
            tree.end()
        if self._log_file is not None:
            self._log_file.close()
            Path(self._log_file.name).unlink(missing_ok=True)
            self._log_file = None

    def completion(self, body: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
        """POST /completion (llama.cpp's native endpoint); the reply's JSON."""
        return self._post("/completion", body, timeout_s)

    def _post(self, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if self.tree is None:
            raise LlamaServerError("llama-server is not running")
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            raise LlamaServerError(f"llama-server {path}: HTTP {err.code}: {err.read()[:500]!r}") from None
        except (urllib.error.URLError, ConnectionError) as err:
            raise LlamaServerError(f"llama-server {path}: {err}\n{self.log_tail()}") from None


def sampling_body(temperature: float, seed: int | None) -> dict[str, Any]:
    """/completion sampling fields for trtssd's SamplingParams(temperature) with top-k, top-p and
    min-p off: only the temperature sampler runs (greedy at 0), as in trtssd."""
    body: dict[str, Any] = {"temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                            "samplers": ["temperature"]}
    if seed is not None:
        body["seed"] = seed
    return body
