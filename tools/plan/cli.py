"""Sharding-plan explorer: rank every (data, tensor, expert) plan of a model on given GPUs by
memory, latency and throughput. The model of the estimates is in `model.py` (its inputs in
`inputs.py`, the search over plans in `search.py`); how to read the output and the equations are
in docs/plan.md.

    pallasite plan llama-3-70b --gpu h100 --gpus-per-host 8 --prompt 512:2048 --output 256 \
        --tpot-ms 50 --json plans.json --png plans.png
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ...model.quant import QUANTIZATIONS
from .inputs import CONSTANTS, GPUS, PRESETS, Cluster, Lengths, Workload, load_model
from .search import explore, to_json

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "f32": 4}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pallasite plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help=f"a config.json path or a preset: {', '.join(PRESETS)}")
    ap.add_argument("--layers", type=int, default=None, help="override the number of layers")
    g = ap.add_argument_group("hardware")
    g.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    g.add_argument("--gpus-per-host", type=int, default=8)
    g.add_argument("--hosts", type=int, default=1)
    g.add_argument("--inter-host-gbps", type=float, default=50.0,
                   help="per-GPU inter-host bandwidth, GB/s one way (400 Gb/s NIC = 50)")
    w = ap.add_argument_group("workload")
    w.add_argument("--prompt", default="1024", help="prompt tokens: N or LO:HI (uniform)")
    w.add_argument("--output", default="256", help="output tokens: N or LO:HI (uniform)")
    w.add_argument("--concurrency", type=int, default=None, help="sequences in flight, at most")
    w.add_argument("--rate", type=float, default=None, help="requests per second to sustain")
    w.add_argument("--weight-dtype", default="bf16", choices=sorted(DTYPE_BYTES))
    w.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS),
                   help="price weights as `pallasite serve --quantization` stores them: fp8 "
                        "linear layers 1 byte; w4a16 / w8a16 dense linear layers 0.53 / 1 byte "
                        "(experts as --weight-dtype); LM head and embedding in --weight-dtype")
    w.add_argument("--kv-dtype", default="bf16", choices=sorted(DTYPE_BYTES))
    w.add_argument("--page-size", type=int, default=16)
    w.add_argument("--chunk", type=int, default=2048, help="prefill tokens per step")
    s = ap.add_argument_group("SLA")
    s.add_argument("--ttft-ms", type=float, default=None)
    s.add_argument("--tpot-ms", type=float, default=None)
    o = ap.add_argument_group("output")
    o.add_argument("--json", default=None, metavar="PATH", help="write the JSON report ('-': stdout)")
    o.add_argument("--png", default=None, metavar="PATH", help="write the frontier/memory picture")
    o.add_argument("--top", type=int, default=None, help="rows of the table (default: all)")
    o.add_argument("--constants", action="store_true", help="print the model's constants")
    return ap


def workload(args) -> Workload:
    return Workload(prompt=Lengths.parse(args.prompt), output=Lengths.parse(args.output),
                    concurrency=args.concurrency, rate=args.rate,
                    weight_bytes=DTYPE_BYTES[args.weight_dtype], quantization=args.quantization,
                    kv_bytes=DTYPE_BYTES[args.kv_dtype],
                    page_size=args.page_size, chunk=args.chunk, ttft_ms=args.ttft_ms,
                    tpot_ms=args.tpot_ms)


def print_constants(console):
    from rich.table import Table
    t = Table(title="model constants")
    for col in ("name", "value", "source"):
        t.add_column(col)
    for name, (value, source) in CONSTANTS.items():
        t.add_row(name, f"{value:g}", source)
    console.print(t)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        config = load_model(args.model, args.layers)
        wl = workload(args)
    except ValueError as err:
        print(f"pallasite plan: {err}", file=sys.stderr)
        return 2
    cluster = Cluster(GPUS[args.gpu], args.gpus_per_host, args.hosts, args.inter_host_gbps)
    records = explore(config, cluster, wl)
    title = (f"{config.name or config.model_type} on {cluster.num_gpus} x {cluster.gpu.name} "
             f"({cluster.hosts} host(s)); prompt {args.prompt}, output {args.output}")
    if args.json:
        text = to_json(config, cluster, wl, records)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.json != "-":
        from rich.console import Console
        from .report import print_table
        # Piped output gets a width that fits the table instead of rich's 80 columns.
        console = Console() if sys.stdout.isatty() else Console(width=170)
        print_table(records, title, console, args.top)
        if args.constants:
            print_constants(console)
    if args.png:
        from .report import write_png
        write_png(records, args.png, title, args.tpot_ms)
    return 0 if any(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
