"""The floor of a Python ext_proc server: CPU per stream of N request/answer messages, by gRPC stack and event loop.

    python -P bench/ext_proc_floor.py [--streams 1500] [--messages 8] [--concurrency 8] [--rounds 2]

A server process per stack answers every ProcessingRequest of a stream at once (no routing work at all); one
grpc.aio client in this process drives `--concurrency` streams at a time. The figure is the server process's CPU
(/proc, user + system) per stream, after 50 warm-up streams, the median over `--rounds` alternated rounds. Stacks:
grpc.aio on asyncio's loop and on uvloop (what `warmfleet epp` runs on), grpc's thread-pool server, and grpclib
(pure Python on h2) when it is installed. It bounds what any EPP written on these stacks can cost: the picker's
ext_proc exchange of one streamed chat request is ~10 such round trips (docs/gateway.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from warmfleet.localprocs import free_port  # noqa: E402

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def answer() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())


def serve(stack: str, port: int) -> None:
    """Run one stack's echo server on 127.0.0.1:port until killed."""
    if stack == "grpc-threads":
        from concurrent.futures import ThreadPoolExecutor

        import grpc

        class Sync(pb_grpc.ExternalProcessorServicer):
            def Process(self, requests, context):
                for _ in requests:
                    yield answer()

        server = grpc.server(ThreadPoolExecutor(64))
        pb_grpc.add_ExternalProcessorServicer_to_server(Sync(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()
        return
    if stack == "grpc.aio+uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_serve_async(stack, port))
    else:
        asyncio.run(_serve_async(stack, port))


async def _serve_async(stack: str, port: int) -> None:
    if stack == "grpclib":
        from grpclib.const import Cardinality, Handler
        from grpclib.server import Server

        class Echo:
            async def Process(self, stream) -> None:
                async for _ in stream:
                    await stream.send_message(answer())

            def __mapping__(self) -> dict:
                return {PROCESS: Handler(self.Process, Cardinality.STREAM_STREAM, pb.ProcessingRequest,
                                         pb.ProcessingResponse)}

        server = Server([Echo()])
        await server.start("127.0.0.1", port)
        await server.wait_closed()
        return
    import grpc

    class Aio(pb_grpc.ExternalProcessorServicer):
        async def Process(self, requests, context):
            async for _ in requests:
                yield answer()

    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Aio(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def one_stream(stub, messages: int) -> None:
    """Send a message, wait for its answer, `messages` times (Envoy's order for headers and streamed bodies)."""
    answered: asyncio.Queue = asyncio.Queue()

    async def requests():
        for _ in range(messages):
            yield pb.ProcessingRequest(request_headers=pb.HttpHeaders())
            await answered.get()

    async for _ in stub.Process(requests()):
        answered.put_nowait(None)


async def measure(stack: str, args) -> float:
    """Server CPU ms per stream for one stack, one round."""
    import grpc

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-P", __file__, "--serve", stack, "--port", str(port)])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.wait_for(channel.channel_ready(), 30)
            stub = pb_grpc.ExternalProcessorStub(channel)
            for _ in range(50):
                await one_stream(stub, args.messages)
            cpu0 = harness.tree_cpu_s(proc.pid)

            async def worker() -> None:
                for _ in range(args.streams // args.concurrency):
                    await one_stream(stub, args.messages)

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            return (harness.tree_cpu_s(proc.pid) - cpu0) * 1000 / (args.streams // args.concurrency * args.concurrency)
    finally:
        proc.kill()
        proc.wait()


def stacks() -> list[str]:
    out = ["grpc.aio", "grpc.aio+uvloop", "grpc-threads"]
    try:
        import grpclib  # noqa: F401
    except ImportError:
        return out
    return out + ["grpclib"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=1500)
    ap.add_argument("--messages", type=int, default=8, help="Request/answer round trips per stream.")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return 0
    runs: dict[str, list[float]] = {s: [] for s in stacks()}
    for r in range(args.rounds):
        for stack in runs:
            t0 = time.monotonic()
            runs[stack].append(asyncio.run(measure(stack, args)))
            print(f"[ext_proc_floor] round {r + 1}/{args.rounds} {stack}: {runs[stack][-1]:.3f} ms CPU per stream "
                  f"({time.monotonic() - t0:.1f} s)", file=sys.stderr)
    out = {"command": " ".join(sys.argv), "messages_per_stream": args.messages, "streams": args.streams,
           "concurrency": args.concurrency,
           "server_cpu_ms_per_stream": {s: round(statistics.median(v), 3) for s, v in runs.items()},
           "server_cpu_us_per_round_trip": {s: round(statistics.median(v) * 1000 / args.messages, 1)
                                            for s, v in runs.items()}}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
