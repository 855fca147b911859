"""Start-up options that cannot work end the server at once with status 2 and one line naming the
option (issue 14): non-positive sizes, a context longer than the model's without SGLang's opt-in,
a KV pool too small for one request. In process they are `InvalidServerArgsError`s, raised before
any memory is allocated."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine import Engine, InvalidServerArgsError, ServerArgs
from tests.server_helpers import REPO, server_env, tiny_model_dir  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(300)
TINY_CONTEXT = 2048  # tests/sched_harness.py: the tiny model's max_position_embeddings


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server", "--dtype", "float32", "--device", "cpu", "--log-level", "warning", *args],
        cwd=REPO,
        env={**server_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=240,
    )


def _one_error_line(res: subprocess.CompletedProcess, *words: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in res.stderr, res.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.mark.parametrize("value", ["0", "-5", "abc"])
def test_chunked_prefill_size_must_be_minus_one_or_positive(value):
    _one_error_line(_serve("--chunked-prefill-size", value), "--chunked-prefill-size")


def test_model_dependent_options_exit_2(tiny_model_dir):
    too_long = _serve("--model-path", tiny_model_dir, "--context-length", "1000000", "--max-total-tokens", "4096")
    _one_error_line(too_long, "context_length", str(TINY_CONTEXT), "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN")
    tiny_pool = _serve("--model-path", tiny_model_dir, "--max-total-tokens", "1")
    _one_error_line(tiny_pool, "max_total_tokens", "too few for one request")


@pytest.mark.parametrize(
    "options, param",
    [
        ({"chunked_prefill_size": 0}, "chunked_prefill_size"),
        ({"chunked_prefill_size": -5}, "chunked_prefill_size"),
        ({"max_running_requests": 0}, "max_running_requests"),
        ({"max_prefill_tokens": -1}, "max_prefill_tokens"),
        ({"max_total_tokens": 0}, "max_total_tokens"),
        ({"context_length": 0}, "context_length"),
        ({"page_size": 0}, "page_size"),
        ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
        ({"schedule_policy": "sjf"}, "schedule_policy"),
        ({"watchdog_timeout": "soon"}, "watchdog_timeout"),
        ({"speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens"),
        ({"speculative_max_verify_tokens": 1}, "speculative_max_verify_tokens"),
        ({"speculative_max_verify_tokens": 0}, "speculative_max_verify_tokens"),
    ],
)
def test_server_args_verify_names_the_option(options, param):
    with pytest.raises(InvalidServerArgsError) as info:
        ServerArgs(**options).verify()
    assert info.value.param == param


def test_valid_server_args_pass():
    ServerArgs().verify()
    ServerArgs(chunked_prefill_size=-1, context_length=512, max_total_tokens=256).verify()
    ServerArgs(chunked_prefill_size=None).verify()


def test_context_length_override_needs_the_opt_in(monkeypatch):
    args = ServerArgs(context_length=4096)
    assert args.check_context_length(8192) == 4096
    with pytest.raises(InvalidServerArgsError, match="SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"):
        args.check_context_length(2048)
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    assert args.check_context_length(2048) == 4096


async def test_engine_start_raises_before_allocating(tiny_model_dir):
    engine = Engine(tiny_model_dir, dtype="float32", device="cpu", torch_threads=1, max_total_tokens=8)
    with pytest.raises(InvalidServerArgsError, match="too few for one request"):
        await engine.start()
    assert not engine.healthy


def test_the_command_line_answers_before_importing_the_engine():
    """`--help` and a bad flag are answered from argparse alone: torch, transformers and the engine
    are imported only once the flags parse (seconds on a small machine)."""
    code = (
        "import sys\nfrom server.launch import main\n"
        "for argv in (['--help'], ['--no-such-flag']):\n"
        "    try:\n        main(argv)\n    except SystemExit as e:\n        print('exit', e.code)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'engine', 'numpy') if m in sys.modules))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.stdout.splitlines()[-3:] == ["exit 0", "exit 2", "[]"], res.stdout[-500:] + res.stderr[-2000:]
    assert "usage: python -m server" in res.stdout and "--no-such-flag" in res.stderr


def test_the_command_lines_choices_mirror_the_engines():
    from engine.layers.attention_backend import ATTENTION_BACKENDS
    from engine.server_args import GRAMMAR_BACKENDS, POOLING_METHODS, SCHEDULE_POLICIES
    from server import cli

    assert cli.SCHEDULE_POLICIES == SCHEDULE_POLICIES and cli.POOLING_METHODS == POOLING_METHODS
    assert cli.GRAMMAR_BACKENDS == GRAMMAR_BACKENDS and cli.ATTENTION_BACKENDS == ATTENTION_BACKENDS
    from engine.layers.weight_quant import TORCHAO_CONFIGS
    from server import kernel_args

    assert kernel_args.TORCHAO_CONFIGS == TORCHAO_CONFIGS
