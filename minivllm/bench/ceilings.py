"""Hardware ceilings measured in the same run as a benchmark: copy bandwidth and bf16 GEMM.

Every GPU figure minivllm reports is given next to these, as a ratio: "1.2 TB/s" means little
until you know the card copies at 4 TB/s. Timing uses CUDA events around many repetitions,
after a warm-up, and takes the median.
"""

from __future__ import annotations

import torch


def _median_ms(fn, repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_us_per_call(fn, calls: int, replays: int = 50) -> float:
    """Median µs per call of `fn`, which makes `calls` dependent kernel calls, captured in one
    CUDA graph and replayed: what each costs in a chain, without the host's launches."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and allocate before the capture
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return _median_ms(graph.replay, repeats=replays) * 1e3 / calls


def copy_bandwidth_gbps(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(num_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def bf16_gemm_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = _median_ms(lambda: a @ b, repeats=20)
    return 2 * n**3 / (ms * 1e-3) / 1e12


if __name__ == "__main__":
    print({"copy_GBps": round(copy_bandwidth_gbps(), 1), "bf16_gemm_TFLOPs": round(bf16_gemm_tflops(), 1),
           "device": torch.cuda.get_device_name()})
