"""A server subprocess over the tiny checkpoint, shared by the module that asks for it, and
the helpers that read its streams and metrics."""
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

# The server is an optional extra: where it is not installed (the GPU machine), these tests are
# not collected rather than failing at import.
if importlib.util.find_spec("fastapi") is None:
    collect_ignore_glob = ["test_*.py"]

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
NUM_KVCACHE_BLOCKS = 64


def start_server(model: str, log_path: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """Start `python -m nanovllm.serve` on a free port; returns (process, base URL) once
    /health answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    # One thread: the tiny model's ops are small, and threads only contend on a shared box.
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log = open(log_path, "w")
    # Its own process group, so that Ctrl-C reaches the server and its engine, as in a shell.
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm.serve", model, "--port", str(port),
                             "--device", "cpu", *args], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:  # not listening yet
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError(f"the server did not start:\n{log_path.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    """Ctrl-C to its process group, as a terminal sends it; kill only if it does not exit."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """(base URL, log path) of a server with an API key, stopped after the module."""
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    proc, url = start_server(tiny_model, log_path, "--num-kvcache-blocks",
                             str(NUM_KVCACHE_BLOCKS), "--api-key", API_KEY,
                             "--served-model-name", "tiny", "--log-level", "warning")
    yield url, log_path
    engine = descendants(proc.pid)
    assert engine, "the engine runs in a process of its own"
    stop_server(proc)
    log = log_path.read_text()
    assert proc.returncode == 0, log[-3000:]
    # Ctrl-C stops the engine process cleanly: joined, not killed
    assert "did not stop in time" not in log, log[-3000:]
    deadline = time.monotonic() + 10
    while any(map(alive, engine)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(alive, engine)), "a process outlived the server"


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:  # it ended meanwhile
                continue
            found += children
            todo += children
    return found


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server[0], timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def stream(client: httpx.Client, route: str, body: dict) -> tuple[list[str], list[dict]]:
    """POST with "stream": true; returns (text pieces, parsed events before [DONE])."""
    pieces, events = [], []
    with client.stream("POST", route, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        event = json.loads(line[len("data: "):])
        events.append(event)
        for choice in event["choices"]:
            piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
            pieces.append(piece or "")
    return pieces, events


def metrics(client: httpx.Client) -> dict[str, float]:
    """nanovllm:* samples without labels: name -> value."""
    values = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("nanovllm:"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


def wait_until_idle(client: httpx.Client, timeout: float = 10) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(client)
        idle = (values["nanovllm:num_requests_running"] == 0
                and values["nanovllm:num_requests_waiting"] == 0)
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.1)
