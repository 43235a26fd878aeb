"""The real server (`python -m jaxserve.cli serve`) in a subprocess, for server tests."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import openai
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from jaxserve.config import EngineConfig
from jaxserve.executables import source_digest
from tests.hf_models import save_engine_model

# The test engines' executable stores (store_of) and start locks (built_once), kept between runs.
TEST_STORE = os.path.join(tempfile.gettempdir(), "jaxserve-test-xla-cache")
# Few step shapes: the largest decode (8 sequences) and prefill (32 tokens) only, every batch padded
# into them (the background warm-up's first stage, for good: tests/test_warmup.py checks the rest).
TEST_ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=32, prefill_chunk_size=32, max_prefill_seqs=1,
                   max_model_len=128, page_size=32, num_pages=64, step_shapes="largest")
READY_TIMEOUT_S = 900   # a cold compilation cache on a busy 2-core machine

# The API tests' server (test_server.py, test_server_extras.py, test_slow_clients.py,
# test_serve_bench.py, test_server_cli.py: same model and settings, so the later ones load the
# first one's executables): a byte-level model, every id a byte or <s> / </s>, with a context
# long enough that a batch of requests runs for seconds even on a quiet machine.
BYTES_MAX_LEN = 2048
BYTES_MODEL = dict(vocab_size=258, max_position_embeddings=BYTES_MAX_LEN)   # save_engine_model's overrides
BYTES_ENGINE = dict(max_queue_size=64, max_model_len=BYTES_MAX_LEN,
                    num_pages=TEST_ENGINE["max_num_seqs"] * BYTES_MAX_LEN // TEST_ENGINE["page_size"])


def store_of(engine: dict) -> str:
    """The executable store of test engines with these settings, shared by every test process: a
    directory of TEST_STORE for each program settings (host-only ones left out, as in the store's
    own key), because a store keeps only the executables of its 8 most recently used engines
    (executables.KEEP_CONTEXTS) and the suite builds more than 8: in one store, the engines
    built between two files that share one would push it out."""
    key = sorted((k, v) for k, v in engine.items() if k not in EngineConfig.HOST_ONLY)
    return os.path.join(TEST_STORE, hashlib.sha256(repr(key).encode()).hexdigest()[:16])


def shared_model(tmp_path_factory, name: str, **overrides) -> str:
    """save_engine_model(**overrides) saved once per test session, at one path for every xdist
    worker: the start lock's key (built_once) holds the model's path, so servers of the same
    model and settings in any test file then load what the first one compiled."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    if not path.exists():
        tmp = tmp_path_factory.mktemp(name)
        save_engine_model(str(tmp), **overrides)
        try:
            os.rename(tmp, path)
        except OSError:   # another worker saved it first
            shutil.rmtree(tmp)
    return str(path)


# The servers whose requests must still be running when something happens to them (a signal:
# test_shutdown.py; a failing step, a deadline: test_faults.py): one model and one engine, so
# their executables are built once for both files. Room for 4 running requests of up to 4096
# tokens; few step shapes.
LONG_MAX_LEN = 4096
LONG_ENGINE = dict(max_model_len=LONG_MAX_LEN, num_pages=520, max_num_seqs=4, max_num_batched_tokens=16,
                   prefill_chunk_size=16)


def long_model(tmp_path_factory) -> str:
    """The path of the seeded byte-level model of LONG_ENGINE's servers, shared."""
    return shared_model(tmp_path_factory, "long-model", vocab_size=258, max_position_embeddings=LONG_MAX_LEN)


def bytes_model_dir(tmp_path_factory) -> str:
    """The path of the seeded byte-level model of BYTES_ENGINE's servers, shared."""
    return shared_model(tmp_path_factory, "bytes-model", **BYTES_MODEL)


def bytes_model(tmp_path_factory):
    """(path, the transformers model, its tokenizer) of the seeded byte-level model, shared."""
    path = bytes_model_dir(tmp_path_factory)
    return path, AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, workdir, model_dir: str, *args: str, **engine):
        self.config = os.path.join(workdir, "engine.yaml")
        settings = {**TEST_ENGINE, **engine}
        with open(self.config, "w") as f:
            yaml.safe_dump({**settings, "compilation_cache_dir": store_of(settings)}, f)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(workdir, "server.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.cli", "serve", "--model", model_dir, "--config", self.config,
             "--port", str(self.port), *args], stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True)   # its own process group, which tests may signal as a whole

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> list[int]:
        """Poll /health until 200; returns the status codes seen (connection refused not counted)."""
        seen, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = requests.get(self.url + "/health", timeout=5)
                seen.append(r.status_code)
                if r.status_code == 200:
                    return seen
            except (requests.ConnectionError, requests.Timeout):   # not listening yet; starting on a busy box
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log_tail()}")

    def wait_warm(self, timeout: float = READY_TIMEOUT_S) -> None:
        """After wait_ready: until warm-up has built every step shape in the background (from then
        on serving compiles nothing at all, which tests read in jaxserve_xla_compilations_total)
        and the roofline gauges, measured after it, are there."""
        deadline = time.monotonic() + timeout
        while (m := self.metrics())["jaxserve_warmup_pending_step_shapes"] > 0 \
                or "jaxserve_model_bandwidth_utilization" not in m:
            if time.monotonic() > deadline:
                raise TimeoutError(f"warm-up not finished after {timeout}s:\n{self.log_tail()}")
            time.sleep(0.25)

    def metrics(self) -> dict[str, float]:
        """Prometheus samples by name ('name{label="value"}' for labelled ones)."""
        text = requests.get(self.url + "/metrics", timeout=30).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-n:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.stop()

    def stop(self, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextlib.contextmanager
def built_once(*key):
    """Around building a warm engine whose executables go to the test store (a server until
    wait_warm, an LLM until warmup() returns). The first builder of `key` (with the sources'
    digest) compiles and stores alone, holding a lock file in the store; the others, from any
    test process, wait for it and then load what it stored (at once, in parallel)."""
    store = os.path.join(TEST_STORE, "test-starts")
    os.makedirs(store, exist_ok=True)
    marker = os.path.join(store, hashlib.sha256(repr((source_digest(), *key)).encode()).hexdigest())
    with open(marker + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(marker):   # stored: no need to wait for one another
            fcntl.flock(lock, fcntl.LOCK_UN)
        yield
        open(marker, "w").close()


def start(workdir, model_dir: str, *args: str, **engine) -> ServerProcess:
    """A warm server (every step shape built, see ServerProcess.wait_warm), built once per model
    and engine settings (built_once). `args` are not in the key: one that changes the engine
    (--tp) at worst starts cold."""
    with built_once(model_dir, sorted({**TEST_ENGINE, **engine}.items())):
        server = ServerProcess(workdir, model_dir, *args, **engine)
        try:
            server.wait_ready()
            server.wait_warm()
        except BaseException:
            server.kill()
            raise
    return server


def serving(workdir, model_dir: str, *args: str, **engine):
    """A module fixture's body (`yield from serving(...)`): the server once warm, and at teardown
    a clean stop, exit 0."""
    s = start(workdir, model_dir, *args, **engine)
    yield s
    assert s.stop() == 0, s.log_tail()


def openai_client(server: ServerProcess, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=120)
