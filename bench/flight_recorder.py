"""The flight recorder's cost: bench.offline's W1 with the recorder on (the default) and off
(`flight_recorder_size=0`), alternating rounds in one run, best of each side; target >= 0.98x.

Also reported, from one more run with the recorder on: events recorded per forward, the ring's
bytes per event, and how long a dump takes (encode + write).

    python -m bench.flight_recorder                 # W1, 3 rounds each side
    python -m bench.flight_recorder --workload W2 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import msgspec
import uvloop

from bench.offline import make_workload, run_ours
from engine import Engine, SamplingParams, load_dump, resolve_model


def _dump_cost(model: str, dtype: str, prompts: list[list[int]], outs: list[int]) -> dict[str, float]:
    """Events per forward, bytes per event and the dump's time, from one run of the workload."""

    async def main() -> dict[str, float]:
        async with Engine(model, dtype=dtype, device="cpu", max_running_requests=len(prompts)) as engine:
            params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in outs]
            await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params)))
            state = await engine.get_internal_state()
            steps = engine.recent_steps()
            forwards = len(steps)
            with tempfile.TemporaryDirectory() as d:
                t0 = time.perf_counter()
                path = Path(engine.dump_flight_recorder("bench", d))
                dump_s = time.perf_counter() - t0
                size = path.stat().st_size
                events_in_dump = load_dump(path).events
        # What recording costs the event loop: encoding each event again, as the ring does.
        t0 = time.perf_counter()
        for event in events_in_dump:
            msgspec.msgpack.encode(event)
        encode_s = time.perf_counter() - t0
        events = state["flight_recorder"]["recorded"]
        return {
            "events": events,
            "events_per_forward": events / max(forwards, 1),
            "bytes_per_event": size / max(events, 1),
            "dump_mb": size / 1e6,
            "dump_s": dump_s,
            "record_us_per_forward": encode_s / max(forwards, 1) * 1e6,
            "forward_ms": sum(s.end - s.start for s in steps) / max(forwards, 1) * 1e3,
        }

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--workload", default="W1", choices=["W1", "W2", "W3"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    # run_ours reads these from bench.offline's options; the engine's defaults otherwise.
    args.threads, args.max_total_tokens, args.disable_cascade_attention = None, None, False
    wl = make_workload(args.workload, resolve_model(args.model_path).hf_config.vocab_size, args.seed)
    best = {"on": 0.0, "off": 0.0}
    for r in range(args.rounds):
        sides = ("on", "off") if r % 2 == 0 else ("off", "on")  # alternate: drift hits both sides
        for side in sides:
            opts = {} if side == "on" else {"flight_recorder_size": 0}
            res = run_ours(wl, args, **opts)
            best[side] = max(best[side], res.tokens_per_s)
            print(
                f"  round {r + 1} recorder {side:>3}: {res.tokens_per_s:8.1f} tok/s ({res.seconds:.2f} s)", flush=True
            )
    ratio = best["on"] / best["off"]
    cost = _dump_cost(args.model_path, args.dtype, wl.prompts, wl.output_lens)
    print(
        f"{args.workload}: recorder on {best['on']:.1f} tok/s, off {best['off']:.1f} tok/s -> "
        f"{ratio:.3f}x (target >= 0.98)\n"
        f"  {cost['events']:.0f} events, {cost['events_per_forward']:.1f} per forward, "
        f"{cost['bytes_per_event']:.0f} bytes each; dump {cost['dump_mb']:.2f} MB in {cost['dump_s'] * 1e3:.0f} ms\n"
        f"  recording: {cost['record_us_per_forward']:.0f} us of encoding per forward of "
        f"{cost['forward_ms']:.1f} ms ({cost['record_us_per_forward'] / 10 / cost['forward_ms']:.3f}%)"
    )
    return ratio


if __name__ == "__main__":
    main()
