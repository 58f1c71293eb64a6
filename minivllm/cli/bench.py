"""`minivllm bench throughput | latency | kernels | ceilings | serve`: the measurements behind
docs/benchmarks.md.

Each subcommand forwards its remaining arguments to the benchmark module, which has its own
`--help`: `minivllm bench throughput --shape qwen3-0.6b --attention-backend triton`.
"""

from __future__ import annotations

import argparse

_BENCHMARKS = {
    "throughput": "offline throughput on the nano-vllm workload, its bound, and --hf (minivllm.bench.throughput)",
    "latency": "one decode step at batch sizes B, beside the weights-read floor (minivllm.bench.latency)",
    "kernels": "each Triton kernel against the hardware and torch, on a GPU (minivllm.bench.kernels)",
    "ceilings": "copy bandwidth and bf16 GEMM rate of this GPU (minivllm.bench.ceilings)",
    "serve": "TTFT, TPOT, ITL and throughput of an OpenAI-compatible server under load (minivllm.bench.serve)",
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark")
    parser.add_argument("benchmark", choices=sorted(_BENCHMARKS), help="; ".join(f"{k}: {v}" for k, v in _BENCHMARKS.items()))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark (see its --help)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"minivllm.bench.{args.benchmark}")
    if args.benchmark == "ceilings":
        print({"copy_GBps": module.copy_bandwidth_gbps(), "bf16_gemm_TFLOPs": module.bf16_gemm_tflops()})
        return 0
    module.main(args.args)
    return 0
