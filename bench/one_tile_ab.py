# Experiment (reverted after it ran): the expand with one B tile a program (all loaded before gdc_wait) vs the default.
import json, os, sys
from dataclasses import asdict, replace
import torch
from bench import kernels as kb
from lorafleet.kernels.triton_lora import pick_config

bw = kb.measure_copy_bandwidth()
g = torch.Generator().manual_seed(0)
rows = []
for module, (d_in, outs) in kb.MODULES.items():
    for t, a in [(64, 64), (64, 8), (16, 1), (256, 128), (64, 1)]:
        case = kb.Case(module, t, a, 16, 16)
        meta = kb.case_meta(case, kb.case_token_slots(case), torch.ones(t, 1))
        d = pick_config(meta.num_chunks, len(outs), d_in, meta.chunk_size, meta.one_pair_chunks)
        cfgs = {"default": d, "one tile": replace(d, block_n=d.n_per_prog)}
        if d.n_per_prog > 256:
            cfgs["one tile of 256"] = replace(d, block_n=256, n_per_prog=256)
        for label, cfg in cfgs.items():
            r = kb.run_case(case, bw, g, config=cfg, baselines=False)
            r.update(label=label, **asdict(cfg))
            rows.append(r)
            print(f"{module:8s} T={t:4d} A={a:4d} {label:16s} {r['lora_us']:7.2f} µs  target {1.3*r['floor_us']+3:6.2f} copy {r['copy_us']:6.2f} err {r['rel_err']}", flush=True)
        torch.cuda.empty_cache()
out = os.environ.get("OUT", "/tmp")
json.dump({"bandwidth_tb_s": bw / 1e12, "rows": rows}, open(f"{out}/kernels-one-tile-h200.json", "w"), indent=1)
