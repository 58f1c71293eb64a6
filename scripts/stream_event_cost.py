"""The CPU cost of one streamed event in minivllm's own server code (chapter 11).

    python scripts/stream_event_cost.py

A fake engine yields 2,000 DELTA outputs of one request as fast as it can; they go through
`OpenAIServingCompletion.stream_chunks` (the async generators between the engine and the
response, the metrics observer, the chunk dicts) and `sse_events` (the JSON). No HTTP, no
engine core, no output processing: what is left of an event's cost beyond this is uvicorn,
starlette and the event loop. Prints the CPU time per event, the best of five runs.
"""
import asyncio, time, sys, types
from minivllm.entrypoints.openai.protocol import CompletionRequest
from minivllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from minivllm.entrypoints.openai.serving_engine import sse_events
from minivllm.metrics import ServerMetrics
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput

N = 2000
class FakeEngine:
    config = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=4096))
    tokenizer = None
    async def generate(self, prompt, params, request_id):
        t = time.time()
        for i in range(N):
            m = RequestMetrics(arrival_time=t - 1, first_token_time=t - 0.5, last_token_time=t + i * 1e-3)
            yield RequestOutput(request_id, None, prompt["prompt_token_ids"], [CompletionOutput(0, "x", [5], None, None, "length" if i == N - 1 else None)], i == N - 1, m)
    async def abort(self, request_id): pass

async def main():
    serving = OpenAIServingCompletion(FakeEngine(), ["m"], ServerMetrics("m"))
    body = CompletionRequest(model="m", prompt=[1, 2, 3], max_tokens=N, stream=True, return_token_ids=True,
                             stream_options={"include_usage": True})
    best = 1e9
    for _ in range(5):
        t0 = time.process_time()
        n = 0
        async for event in sse_events(await serving.stream_chunks(body)):
            n += 1
        best = min(best, (time.process_time() - t0) / n)
    print(f"{n} events, {best * 1e6:.1f} us CPU per event (best of 5)")
asyncio.run(main())
