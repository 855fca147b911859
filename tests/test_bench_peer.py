"""bench.peer's llama-server side, against a stand-in `llama-server` (a script speaking the same
HTTP API): the command line it builds, readiness, the request bodies (the same prompt ids,
greedy, exactly n tokens, no prompt cache), counting and shutdown. The real binary is built
separately (docs/PERFORMANCE.md has the measured comparison)."""

from __future__ import annotations

import json
import stat
import sys
import textwrap

import pytest

from bench.offline import Workload
from bench.peer import completion_body, run_peer
from tests.server_helpers import free_port

FAKE_SERVER = textwrap.dedent(
    """
    import argparse, json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    p = argparse.ArgumentParser()
    for flag in ("--model", "--host", "--port", "--threads", "--threads-batch", "--parallel", "--ctx-size"):
        p.add_argument(flag)
    p.add_argument("--no-webui", action="store_true")
    args = p.parse_args()
    log = open(LOG, "a")
    log.write(json.dumps({"argv": sys.argv[1:]}) + "\\n")
    log.flush()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200 if self.path == "/health" else 404, {"status": "ok"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            log.write(json.dumps({"body": body}) + "\\n")
            log.flush()
            self._send(200, {"content": "x", "tokens_predicted": body["n_predict"]})

        def log_message(self, *a):
            pass

    ThreadingHTTPServer((args.host, int(args.port)), Handler).serve_forever()
    """
)


@pytest.fixture
def fake_llama_server(tmp_path):
    log = tmp_path / "requests.jsonl"
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\nLOG = {str(log)!r}\n{FAKE_SERVER}")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script, log


def test_runs_the_workload_against_a_llama_server(fake_llama_server, tmp_path):
    script, log = fake_llama_server
    wl = Workload("t", [[101, 102, 103], [7] * 40, [9, 9]], [5, 3, 8])
    result = run_peer(str(script), tmp_path / "m.gguf", wl, threads=2, port=free_port())
    assert result.method == "llama-server" and result.output_tokens == 16 and result.seconds > 0
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    argv = lines[0]["argv"]
    assert argv[argv.index("--parallel") + 1] == "3" and argv[argv.index("--threads") + 1] == "2"
    assert int(argv[argv.index("--ctx-size") + 1]) >= 3 * (40 + 3)  # every slot holds its request
    bodies = [x["body"] for x in lines[1:]]
    assert bodies[0]["n_predict"] == 4  # the warm-up
    sent = sorted((tuple(b["prompt"]), b["n_predict"]) for b in bodies[1:])
    assert sent == sorted((tuple(p), n) for p, n in zip(wl.prompts, wl.output_lens))
    assert all(b == completion_body(b["prompt"], b["n_predict"]) for b in bodies)
    assert bodies[1]["temperature"] == 0.0 and bodies[1]["ignore_eos"] and not bodies[1]["cache_prompt"]


def test_a_peer_that_dies_at_start_is_an_error(tmp_path):
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\nimport sys\nsys.exit(3)\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(RuntimeError, match="exited with status 3"):
        run_peer(str(script), tmp_path / "m.gguf", Workload("t", [[1, 2]], [2]), threads=1, port=free_port())
