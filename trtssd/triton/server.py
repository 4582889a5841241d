"""`trtssd triton-serve`: run Triton Inference Server on a model repository, with the tritonserver
binary the nvidia-pytriton wheel ships (Triton 2.51, release r24.10, with its Python backend).

The wheel's binary needs three things its Python API would otherwise arrange:
- its shared libraries, in the wheel's ``nvidia_pytriton.libs`` (put on LD_LIBRARY_PATH);
- a backend directory holding the Python backend *and* the backend stub built for the running
  Python (the wheel keeps one stub per Python version apart): a copy is made per server;
- the system libpython of that version, which the stub links (checked before starting).

The server runs in a session of its own, so a terminal's Ctrl-C reaches only this process, which
then stops the server (SIGTERM: Triton unloads the model, whose finalize stops the draft rank).
Whatever the server started is then checked: a process still running is killed and a
shared-memory segment still present (trtssd's, MPICH's, the Python backend's) is removed, only
those the server's own processes had mapped.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from trtssd.processes import ProcessTree

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 60.0  # SIGTERM -> exit; Triton itself waits up to 30 s for open requests (--exit-timeout-secs)
LEFTOVER_GRACE_S = 10.0  # the draft rank exits by itself once the model's process is gone; give it a moment
SHM_PREFIXES = ("trtssd-", "mpich_shm_", "triton_python_backend_shm_region_")


@dataclass(frozen=True)
class TritonInstall:
    """The server binary of the nvidia-pytriton wheel and what it needs."""

    binary: Path
    backends: Path  # the wheel's backends/ (python/ without a stub)
    stub: Path  # the Python backend stub for this Python version
    libs: Path  # the wheel's shared libraries

    @classmethod
    def find(cls) -> "TritonInstall":
        spec = importlib.util.find_spec("pytriton")  # located, not imported: only its files are used
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("tritonserver not found: install the 'nvidia-pytriton' wheel "
                               "(pip install 'trtssd[triton]')")
        package = Path(next(iter(spec.submodule_search_locations)))
        root = package / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        install = cls(root / "bin" / "tritonserver", root / "backends",
                      root / "python_backend_stubs" / version / "triton_python_backend_stub",
                      package.parent / "nvidia_pytriton.libs")
        for path in (install.binary, install.backends, install.libs):
            if not path.exists():
                raise RuntimeError(f"the nvidia-pytriton wheel lacks {path}: reinstall it")
        if not install.stub.exists():
            raise RuntimeError(f"the nvidia-pytriton wheel has no Python backend stub for Python {version} "
                               f"({install.stub})")
        return install

    def check_stub_libraries(self) -> None:
        """The stub links the system libpython of its version; say so clearly when it is missing."""
        result = subprocess.run(["ldd", str(self.stub)], capture_output=True, text=True,
                                env={**os.environ, "LD_LIBRARY_PATH": self.library_path()})
        missing = [line.split()[0] for line in result.stdout.splitlines() if "not found" in line]
        if missing:
            raise RuntimeError(f"Triton's Python backend stub {self.stub} needs {', '.join(missing)}; on Debian or "
                               f"Ubuntu: apt-get install libpython{sys.version_info.major}.{sys.version_info.minor}")

    def library_path(self) -> str:
        return os.pathsep.join(p for p in (str(self.libs), os.environ.get("LD_LIBRARY_PATH", "")) if p)

    def prepare_backends(self, directory: Path) -> Path:
        """A backend directory with the stub for this Python in ``python/``; returns it."""
        backends = directory / "backends"
        shutil.copytree(self.backends, backends, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(self.stub, backends / "python" / "triton_python_backend_stub")
        return backends


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    def resolved(self) -> "Ports":
        """Port 0 replaced by a free port (tritonserver cannot report the port it bound)."""
        return Ports(*(p or free_port() for p in (self.http, self.grpc, self.metrics)))


class TritonServer:
    """One tritonserver process on a model repository (see the module docstring).

    log_path: where the server's output goes (None: this process's stdout and stderr)."""

    def __init__(self, repository: str | os.PathLike, ports: Ports = Ports(), host: str = "127.0.0.1",
                 log_path: str | os.PathLike | None = None, extra_args: tuple[str, ...] = ()):
        self.repository = Path(repository).resolve()
        if not (self.repository / "trtssd" / "config.pbtxt").is_file():
            raise ValueError(f"{self.repository} is not a trtssd model repository (no trtssd/config.pbtxt); write one "
                             "with `trtssd triton-repo --out DIR`")
        self.ports = ports.resolved()
        self.host = host
        self.log_path = Path(log_path) if log_path is not None else None
        self.extra_args = tuple(extra_args)
        self._tree: ProcessTree | None = None
        self._workdir: Path | None = None

    @property
    def process(self) -> subprocess.Popen | None:
        return self._tree.process if self._tree is not None else None

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.ports.http}"

    def start(self) -> "TritonServer":
        install = TritonInstall.find()
        install.check_stub_libraries()
        self._workdir = Path(tempfile.mkdtemp(prefix="trtssd-triton-"))
        backends = install.prepare_backends(self._workdir)
        command = [
            str(install.binary), f"--model-repository={self.repository}", f"--backend-directory={backends}",
            f"--http-address={self.host}", f"--http-port={self.ports.http}",
            f"--grpc-address={self.host}", f"--grpc-port={self.ports.grpc}",
            f"--metrics-address={self.host}", f"--metrics-port={self.ports.metrics}",
            # The config is complete; auto-completion would load the model once more in a throw-away stub.
            "--disable-auto-complete-config", "--allow-gpu-metrics=false", *self.extra_args,
        ]
        output = open(self.log_path, "ab") if self.log_path is not None else None
        try:
            self._tree = ProcessTree(command, env={**os.environ, "LD_LIBRARY_PATH": install.library_path()},
                                     stdout=output, stderr=output, shm_prefixes=SHM_PREFIXES)
        finally:
            if output is not None:
                output.close()
        log.info("tritonserver pid %d: HTTP %s, gRPC %s:%d, metrics %s:%d", self.process.pid, self.http_url,
                 self.host, self.ports.grpc, self.host, self.ports.metrics)
        return self

    def running(self) -> bool:
        return self._tree is not None and self._tree.running()

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Wait until every model is loaded (GET /v2/health/ready); raise if the server exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running():
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} before it was ready"
                                   f"{self._log_tail()}")
            if self.ready():
                self.record()
                return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver was not ready within {timeout_s:.0f} s{self._log_tail()}")

    def ready(self) -> bool:
        """Every model loaded (Triton's GET /v2/health/ready)."""
        return _http_ok(f"{self.http_url}/v2/health/ready")

    def record(self) -> None:
        """Note the processes the server started and the shared memory they map (call while it runs;
        `stop` does too)."""
        if self._tree is not None:
            self._tree.record()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait, SIGKILL if need be; then end and remove whatever it left (idempotent).
        Returns the server's exit code."""
        if self._tree is None:
            return None
        code = self._tree.stop(timeout_s)
        # A clean stop leaves nothing: whatever is left is worth a warning.
        leftovers = self._tree.end(LEFTOVER_GRACE_S)
        for pid in leftovers.killed:
            log.warning("process %d started by tritonserver outlived it: killed it", pid)
        for path in leftovers.removed:
            log.warning("removed shared memory %s left by the server's processes", path)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        return code

    def _log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return ":\n" + "\n".join(tail)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_foreground(server: TritonServer) -> int:
    """Run until the server exits or this process gets SIGINT/SIGTERM; then stop everything.
    Returns 0 after a signal, else the server's exit code."""
    stop = threading.Event()
    handlers = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        announced = False
        while server.running() and not stop.wait(0.5):
            server.record()  # the model's processes (the draft rank too) appear while it loads
            if not announced and server.ready():
                announced = True
                log.warning("Triton serves %s: HTTP %s, gRPC %s:%d, metrics http://%s:%d/metrics", server.repository,
                            server.http_url, server.host, server.ports.grpc, server.host, server.ports.metrics)
    finally:
        code = server.stop()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return 0 if stop.is_set() else (code or 0)


def free_port() -> int:
    """A TCP port nothing listens on now (it could be taken before the server binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


