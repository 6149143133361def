"""A vLLM process that answers prompts sent on stdin: one start, many requests.

Used by the integration tests and `kvsieve bench vllm`, which need several
vLLM processes (restarts, two instances) and cannot afford a vLLM start per
question. Run as `python -m engine_adapter.vllm.driver --model DIR [--kv-transfer-config JSON]`;
each stdin line is a JSON request `{"prompts": [[token ids], ...], "max_tokens": N}`;
each answer is one stdout line `KVSIEVE_DRIVER {"outputs": [[token ids], ...], "elapsed_s": S}`
(vLLM's own logs share stdout, hence the marker). Greedy decoding throughout.

A request with `"concurrency": C` is a load run instead (`closed_loop`): its prompts
are sent in order with C in flight at a time (a new one as soon as one finishes), and
the answer adds each prompt's time to first token (`ttft_s`, vLLM's own measure when
it logs stats, else the time to its last token) and the run's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

MARKER = "KVSIEVE_DRIVER "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments of the driver."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local model directory")
    p.add_argument("--kv-transfer-config", default="", help="vLLM KVTransferConfig as JSON (empty: none)")
    p.add_argument("--kv-events-config", default="", help="vLLM KVEventsConfig as JSON (empty: none)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--prefix-caching", action="store_true", help="enable vLLM's own prefix cache")
    p.add_argument("--eager", action="store_true", help="no torch.compile: starts in seconds, runs slower")
    p.add_argument("--dtype", default="auto", help="model dtype (auto: bfloat16 on CPU)")
    p.add_argument("--log-stats", action="store_true", help="vLLM's per-request stats (first-token times)")
    p.add_argument("--num-blocks", type=int, default=0, help="vLLM cache blocks (0: as many as fit)")
    return p.parse_args(argv)


def build_llm(args: argparse.Namespace) -> Any:
    """The `vllm.LLM` the arguments describe."""
    from vllm import LLM

    extra: dict[str, Any] = {}
    if args.kv_transfer_config:
        from vllm.config import KVTransferConfig

        extra["kv_transfer_config"] = KVTransferConfig(**json.loads(args.kv_transfer_config))
    if args.kv_events_config:
        from vllm.config import KVEventsConfig

        extra["kv_events_config"] = KVEventsConfig(**json.loads(args.kv_events_config))
    if args.num_blocks:
        extra["num_gpu_blocks_override"] = args.num_blocks
    return LLM(
        model=args.model,
        disable_log_stats=not args.log_stats,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.prefix_caching,
        enforce_eager=args.eager,
        dtype=args.dtype,
        **extra,
    )


def answer(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    """Greedy completions of the request's prompts, and the wall time of the call."""
    from vllm import SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in request["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=int(request.get("max_tokens", 16)))
    if request.get("concurrency"):
        return closed_loop(llm, prompts, params, int(request["concurrency"]))
    t0 = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return {"outputs": [list(r.outputs[0].token_ids) for r in results], "elapsed_s": elapsed}


def closed_loop(llm: Any, prompts: list[Any], params: Any, concurrency: int) -> dict[str, Any]:
    """Send `prompts` in order, `concurrency` in flight at a time; each one's output and time to
    first token, and the run's wall time."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    engine = llm.llm_engine
    outputs: list[list[int]] = [[] for _ in prompts]
    ttft = [0.0] * len(prompts)
    in_flight: dict[str, tuple[int, float]] = {}
    t0 = time.perf_counter()
    sent = 0
    while sent < len(prompts) or in_flight:
        while sent < len(prompts) and len(in_flight) < concurrency:
            (request_id,) = llm.enqueue([prompts[sent]], params, use_tqdm=False)
            in_flight[request_id] = (sent, time.perf_counter())
            sent += 1
        for out in engine.step():
            key = _request_key(out.request_id, in_flight) if out.finished else None
            if key is None:
                continue
            index, started = in_flight.pop(key)
            outputs[index] = list(out.outputs[0].token_ids)
            latency = getattr(out.metrics, "first_token_latency", 0.0) if out.metrics else 0.0
            ttft[index] = latency if latency > 0 else time.perf_counter() - started
    return {
        "outputs": outputs,
        "ttft_s": ttft,
        "elapsed_s": time.perf_counter() - t0,
    }


def _request_key(output_id: str, in_flight: Mapping[str, Any]) -> str | None:
    """The key of `in_flight` an output belongs to: `enqueue` returns vLLM's internal request id
    (the caller's id plus a random suffix), the outputs carry the caller's id."""
    if output_id in in_flight:
        return output_id
    return next((key for key in in_flight if key.startswith(f"{output_id}-")), None)


def main(argv: list[str] | None = None) -> int:
    """Start vLLM, say "ready", then answer stdin lines until EOF."""
    llm = build_llm(parse_args(argv))
    _say({"ready": True})
    for line in sys.stdin:
        if line.strip():
            _say(answer(llm, json.loads(line)))
    return 0


class DriverProcess:
    """The parent's handle on a driver process: start it, ask it, stop it.

    vLLM's log lines are kept (`log_lines`) so that callers can check what the
    connector logged. Start blocks until vLLM is ready (the first start compiles:
    minutes; later ones read ~/.cache/vllm).

    Args:
        model: local model directory.
        kv_transfer_config: vLLM's KVTransferConfig as a dict; None runs vLLM without a connector.
        kv_events_config: vLLM's KVEventsConfig as a dict (KV events on a ZMQ socket); None: none.
        prefix_caching: enable vLLM's own prefix cache.
        eager: skip torch.compile (a start takes seconds instead of minutes; compute is slower).
        dtype: the model dtype ("auto", "float32", ...).
        log_stats: vLLM's per-request stats (a load run's first-token times come from them).
        num_blocks: vLLM's cache blocks (0: as many as its KV cache space holds).
        env: extra environment (VLLM_CPU_KVCACHE_SPACE defaults to 1 GiB).
        log_path: also append vLLM's output to this file.
    """

    def __init__(
        self,
        model: str | Path,
        kv_transfer_config: Mapping[str, Any] | None = None,
        *,
        kv_events_config: Mapping[str, Any] | None = None,
        prefix_caching: bool = False,
        eager: bool = False,
        dtype: str = "auto",
        max_model_len: int = 4096,
        log_stats: bool = False,
        num_blocks: int = 0,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
    ) -> None:
        cmd = [sys.executable, "-m", "engine_adapter.vllm.driver", "--model", str(model)]
        cmd += ["--max-model-len", str(max_model_len)]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
        if kv_events_config is not None:
            cmd += ["--kv-events-config", json.dumps(dict(kv_events_config))]
        if prefix_caching:
            cmd.append("--prefix-caching")
        if eager:
            cmd.append("--eager")
        cmd += ["--dtype", dtype]
        if log_stats:
            cmd.append("--log-stats")
        if num_blocks:
            cmd += ["--num-blocks", str(num_blocks)]
        full_env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ, **(env or {})}
        self.log_lines: list[str] = []
        self._log = open(log_path, "a") if log_path is not None else None  # noqa: SIM115 (closed in stop)
        self._replies: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
        )
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    def wait_ready(self, timeout_s: float = 900) -> None:
        """Block until vLLM has started (raises RuntimeError with its last log lines if it died)."""
        self._next_reply(timeout_s)

    def ask(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = 16, timeout_s: float = 600
    ) -> dict[str, Any]:
        """Greedy completions of `prompts` (token ids): {"outputs": [...], "elapsed_s": ...}."""
        request = {"prompts": [list(map(int, p)) for p in prompts], "max_tokens": max_tokens}
        return self._request(request, timeout_s)

    def closed_loop(
        self, prompts: Sequence[Sequence[int]], concurrency: int, max_tokens: int = 16, timeout_s: float = 600
    ) -> dict[str, Any]:
        """A load run (`closed_loop`): {"outputs", "ttft_s", "elapsed_s"}."""
        request = {
            "prompts": [list(map(int, p)) for p in prompts],
            "max_tokens": max_tokens,
            "concurrency": concurrency,
        }
        return self._request(request, timeout_s)

    def _request(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._next_reply(timeout_s)

    def stop(self, timeout_s: float = 60) -> int:
        """Close stdin and wait for vLLM to exit (killed past the timeout); the exit code."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(30)
        self._reader.join(30)
        if self._log is not None:
            self._log.close()
        return code

    def _read(self, stream: IO[str]) -> None:
        for raw in stream:
            reply, line = _split_reply(raw)
            if reply is not None:
                with self._cond:
                    self._replies.append(reply)
                    self._cond.notify_all()
                if not line.strip():
                    continue
            self.log_lines.append(line.rstrip("\n"))
            if self._log is not None:
                self._log.write(line)
                self._log.flush()
        with self._cond:
            self._cond.notify_all()

    def _next_reply(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._replies:
                if not self._reader.is_alive():
                    tail = "\n".join(self.log_lines[-30:])
                    # The root cause is the first error line; the traceback's tail is its consequence.
                    cause = next((ln for ln in self.log_lines if "Error: " in ln), "")
                    raise RuntimeError(f"vLLM driver exited ({self.proc.poll()}): {cause}\n{tail}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"vLLM driver gave no answer in {timeout_s:.0f} s")
                self._cond.wait(min(left, 1.0))
            return self._replies.pop(0)


def _say(message: dict[str, Any]) -> None:
    """One reply line in ONE write: vLLM's worker processes log to the same pipe, and a
    line written in two parts (text, then newline) can get their output in between."""
    sys.stdout.write(f"{MARKER}{json.dumps(message)}\n")
    sys.stdout.flush()


def _split_reply(line: str) -> tuple[dict[str, Any] | None, str]:
    """(the reply on `line`, if any; the rest of the line, log text from other processes)."""
    start = line.find(MARKER)
    if start < 0:
        return None, line
    reply, end = json.JSONDecoder().raw_decode(line, start + len(MARKER))
    return reply, line[:start] + line[end:]


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps the child from re-running this
    sys.exit(main())
