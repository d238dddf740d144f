"""`lorafleet up` end to end, as a new user runs it: the README's command in the background, the
official `openai` client against the router, `lorafleet adapters apply -f` an example manifest,
then SIGTERM and a check that no process is left."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "adapters.yaml"
PROMPT = "SELECT name FROM"


def readme_run_command() -> list[str]:
    """The `lorafleet up` part of the README's run command (the first bash block of the quick start)."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    last = block.strip().split("&&")[-1].split()
    assert last[:2] == ["lorafleet", "up"], block
    return last[1:]


def lorafleet_cmd() -> list[str]:
    exe = shutil.which("lorafleet")
    return [exe] if exe else [sys.executable, "-m", "lorafleet"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_mentioning(text: str) -> list[tuple[int, str]]:
    """Live processes whose command line contains `text` (the run dir is in every worker's argv)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if text in cmdline and "zombie" not in state:
            found.append((int(entry.name), cmdline))
    return found


@dataclass
class Fleet:
    process: subprocess.Popen
    cwd: Path
    url: str
    stdout: list[str]
    store: str = ""

    @property
    def run_dir(self) -> Path:
        return self.cwd / ".lorafleet"

    def adapters(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([*lorafleet_cmd(), "adapters", *args], cwd=self.cwd, input=stdin,
                              capture_output=True, text=True, timeout=120)


def start_fleet(cwd: Path, port: int, assets: Path, *extra: str) -> Fleet:
    # The README's run command, on a free port; the demo assets come from the session fixture.
    process = subprocess.Popen(
        [*lorafleet_cmd(), *readme_run_command(), "--port", str(port), "--assets", str(assets), *extra],
        cwd=cwd, stdout=subprocess.PIPE, stderr=open(cwd / "up.stderr", "w"), text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    up = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if "Press Ctrl-C to stop" in line:
                up.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 150
    while not up.is_set():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"lorafleet up did not come up (rc {process.returncode}):\n"
                                 f"{''.join(lines)}\n{(cwd / 'up.stderr').read_text()}")
        time.sleep(0.1)
    return Fleet(process, cwd, f"http://127.0.0.1:{port}", lines)


def stop_fleet(fleet: Fleet) -> int:
    fleet.process.send_signal(signal.SIGTERM)
    try:
        return fleet.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(fleet.process.pid, signal.SIGKILL)
        raise


def redis_answers() -> bool:
    try:
        socket.create_connection(("127.0.0.1", 6379), timeout=0.5).close()
    except OSError:
        return False
    return True


@pytest.fixture(params=["redis", "embedded"])
def fleet(request: pytest.FixtureRequest, tmp_path: Path, demo_assets: Path) -> Iterator[Fleet]:
    """Placement state in Redis when one answers (CI starts one), and embedded in-process state."""
    if request.param == "redis" and not redis_answers():
        pytest.skip("no Redis on 127.0.0.1:6379")
    extra = ["--no-redis"] if request.param == "embedded" else []
    fleet = start_fleet(tmp_path, free_port(), demo_assets, *extra)
    fleet.store = request.param
    yield fleet
    if fleet.process.poll() is None:  # a failed test: still leave nothing behind
        stop_fleet(fleet)


def complete(client, model: str, **extra) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, **extra)
    return out.choices[0].text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_fleet_end_to_end(fleet: Fleet) -> None:
    from openai import NotFoundError, OpenAI

    banner = "".join(fleet.stdout)
    assert f"{fleet.url}/v1" in banner and "curl" in banner and "from openai import OpenAI" in banner
    assert ("state: redis://" if fleet.store == "redis" else "state: embedded") in banner
    state = json.loads((fleet.run_dir / "state.json").read_text())
    assert len(state["workers"]) == 2
    client = OpenAI(base_url=f"{fleet.url}/v1", api_key="local", max_retries=0, timeout=60)

    models = {m.id for m in client.models.list().data}
    assert {"tiny-llama", "sql", "chat", "poem", "code", "legal"} <= models

    # Three adapters, each twice at temperature 0: repeatable, and different per adapter.
    answers = {name: complete(client, name) for name in ("sql", "chat", "poem")}
    for name, text in answers.items():
        assert text, name
        assert complete(client, name) == text, f"{name} is not deterministic at temperature 0"
    assert len(set(answers.values())) == 3, answers

    # A composed request: the base model with two adapters at half scale (the RFC's lora_adapters).
    composed_body = {"lora_adapters": [{"name": "sql", "scale": 0.5}, {"name": "poem", "scale": 0.5}]}
    composed = complete(client, "tiny-llama", extra_body=composed_body)
    assert composed == complete(client, "tiny-llama", extra_body=composed_body)
    assert composed not in answers.values()
    assert complete(client, "tiny-llama") not in {composed, *answers.values()}

    # The example manifest as for kubectl: its sources go on the local adapter volume first.
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    for doc in docs:
        shutil.copytree(fleet.run_dir / "adapters" / "sql", fleet.run_dir / "adapters" / doc["spec"]["source"])
    applied = fleet.adapters("apply", "-f", str(EXAMPLE))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    for doc in docs:
        assert f"loraadapter.lorafleet.dev/{doc['metadata']['name']} created" in applied.stdout
    # Same weights as `sql` under another name: the same answer, from whichever worker holds it.
    assert complete(client, "sql-writer") == answers["sql"]
    listing = fleet.adapters("get")
    assert "support-de" in listing.stdout and "Ready" in listing.stdout

    # Re-applying is a no-op; an invalid manifest is refused with the field named.
    again = fleet.adapters("apply", "-f", str(EXAMPLE))
    assert "sql-writer unchanged" in again.stdout
    bad = fleet.adapters("apply", "-f", "-", stdin=(
        "apiVersion: lorafleet.dev/v1alpha1\nkind: LoraAdapter\nmetadata: {name: bad}\n"
        "spec: {pool: local, source: sql, replicas: {min: 0, max: 0}}\n"
    ))
    assert bad.returncode == 1 and "spec.replicas.max" in bad.stderr, bad.stderr

    # Deleted: out of the router's catalog too, so a request is a 404 and never a cold load back.
    deleted = fleet.adapters("delete", "sql-writer")
    assert deleted.returncode == 0, deleted.stdout + deleted.stderr
    deadline = time.monotonic() + 10
    while "sql-writer" in {m.id for m in client.models.list().data}:
        assert time.monotonic() < deadline, "the router still lists a deleted adapter"
        time.sleep(0.2)
    with pytest.raises(NotFoundError):
        complete(client, "sql-writer")

    # SIGTERM: everything stops, nothing is left.
    worker_pids = [w["pid"] for w in state["workers"]]
    assert stop_fleet(fleet) == 0
    deadline = time.monotonic() + 10
    while processes_mentioning(str(fleet.run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(str(fleet.run_dir)) == []
    for pid in [fleet.process.pid, *worker_pids]:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # neither the process nor anything in its group is alive
    assert not (fleet.run_dir / "state.json").exists()


def test_port_taken_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run([*lorafleet_cmd(), "up", "--port", str(port), "--assets", str(tmp_path / "none")],
                                cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"port {port} on 127.0.0.1 is taken" in result.stderr
    assert not (tmp_path / "none").exists()  # checked before making anything


def test_adapters_without_a_fleet_says_so(tmp_path: Path) -> None:
    result = subprocess.run([*lorafleet_cmd(), "adapters", "get"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "lorafleet up" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_fleet_serves_fp8_weights(tmp_path: Path, demo_assets: Path) -> None:
    """`lorafleet up --quantization fp8`: the worker runs with the flag and the router's greedy answer is
    the offline FP8 engine's, which differs from the unquantized engine's on this prompt."""
    import httpx

    from lorafleet.worker.config import EngineConfig
    from lorafleet.worker.engine.engine import LLMEngine
    from lorafleet.worker.engine.sequence import SamplingParams

    fleet = start_fleet(tmp_path, free_port(), demo_assets, "--quantization", "fp8", "--workers", "1", "--no-redis")
    try:
        state = json.loads((fleet.run_dir / "state.json").read_text())
        cmdline = Path(f"/proc/{state['workers'][0]['pid']}/cmdline").read_bytes().split(b"\0")
        assert cmdline[cmdline.index(b"--quantization") + 1] == b"fp8"
        body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        served = httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert stop_fleet(fleet) == 0
    finally:
        if fleet.process.poll() is None:
            stop_fleet(fleet)

    def offline(quantization: str | None) -> str:
        engine = LLMEngine(demo_assets / "model", EngineConfig(dtype="float32", num_kv_blocks=64, quantization=quantization))
        rid = engine.add_request(PROMPT, SamplingParams(max_tokens=12, temperature=0.0))
        text = ""
        while engine.has_unfinished():
            text += "".join(o.text_delta for o in engine.step() if o.request_id == rid)
        return text

    assert served == offline("fp8") != offline(None)
