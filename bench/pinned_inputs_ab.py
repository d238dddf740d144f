"""A/B on one engine (an H200 experiment, reverted): decode step inputs from pageable vs pinned memory
(DecodeGraphs.pin_inputs). `python -m bench.pinned_inputs_ab` -> $OUT/pinned-inputs-h200.json."""
import argparse
import json
import os

import torch

from bench.engine import adapter_sets, build_engine, decode_run, register_random_adapters

args = argparse.Namespace(tiny=False, rank=16, batch=64, modes="async")
engine, model_config, _ = build_engine(args, "cuda", 64)
names = register_random_adapters(engine, model_config, 64, 16)
graphs = engine.runner.graphs
decode_run(engine, adapter_sets(names, 64, 64), 16, 4)
rows = []
for rep in range(2):
    for pin in (False, True):
        graphs.pin_inputs = pin
        for d in (0, 8, 64):
            sets = adapter_sets(names, d, 64)
            decode_run(engine, sets, 128, 8)
            res = decode_run(engine, sets, 128, 128)
            rows.append({"pass": rep, "pinned": pin, "adapters": d, **res})
            print(f"pass {rep} pinned {pin!s:5} {d:>2} adapters: {res['tokens_per_s']:>9,.0f} tok/s step {res['decode_step_ms']} ms",
                  flush=True)
for r in rows:
    base = next(q["tokens_per_s"] for q in rows if q["pass"] == r["pass"] and q["pinned"] == r["pinned"] and q["adapters"] == 0)
    r["vs_base"] = round(r["tokens_per_s"] / base, 3)
    print(r["pass"], r["pinned"], r["adapters"], r["tokens_per_s"], r["vs_base"])
out = os.environ.get("OUT", "/tmp")
with open(f"{out}/pinned-inputs-h200.json", "w") as f:
    json.dump({"machine": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": 64, "prompt_len": 128,
               "new_tokens": 128, "rows": rows}, f, indent=1)
