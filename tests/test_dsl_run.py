"""Programs on the real model: shared prefixes computed once, batches, kill, yields, pins."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_adapter.dsl import Limits, ProgramError, plan, run_program
from engine_adapter.dsl.run import ProgramRun
from kvstore.config import StoreConfig
from kvstore.store.tiered import TieredStore

pytestmark = [pytest.mark.model, pytest.mark.slow]
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LICENSE = Path("/usr/share/common-licenses/Apache-2.0")
SYSTEM = 'system "You are a helpful AI assistant named SmolLM, trained by Hugging Face"'


@pytest.fixture(scope="module")
def lm():  # type: ignore[no-untyped-def]
    from engine_adapter.runner.model import load_model

    return load_model(quiet=True)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    with TieredStore(StoreConfig(data_dir=tmp_path / "data", block_tokens=32, chunk_tokens=8)) as s:
        yield s


@pytest.fixture
def engine(lm, store: TieredStore):  # type: ignore[no-untyped-def]
    from engine_adapter.runner.engine import Engine

    return Engine(lm, store)


def _document(chars: int = 1200) -> str:
    return LICENSE.read_text()[:chars] if LICENSE.exists() else "Licensed under the Apache License. " * 40


def _run(engine, source: str, args: dict, limits: Limits | None = None) -> tuple[list, ProgramRun]:  # type: ignore[no-untyped-def]
    run = ProgramRun(engine, plan(source, limits), args)
    return list(run.events()), run


@pytest.mark.real_weights  # the answer names Paris
def test_chatbot_example(engine, store: TieredStore) -> None:  # type: ignore[no-untyped-def]
    events, _ = _run(
        engine, (EXAMPLES / "chatbot.kvs").read_text(), {"question": "What is the capital of France?"}
    )
    yields = {e.name: e.value for e in events if e.kind == "yield"}
    assert events[-1].kind == "done"
    assert "Paris" in yields["answer"]
    assert yields["critic"] in ("Yes", "No")  # select never returns anything else
    assert isinstance(yields["follow"], list) and 1 <= len(yields["follow"]) <= 3
    assert store.stats().active_leases == 0  # pins released at the end


def test_map_reduce_example_decodes_branches_as_one_batch(engine) -> None:  # type: ignore[no-untyped-def]
    text = _document(1500)
    parts = {"part1": text[:500], "part2": text[500:1000], "part3": text[1000:]}
    events, run = _run(engine, (EXAMPLES / "map_reduce.kvs").read_text(), parts)
    names = [e.name for e in events if e.kind == "yield"]
    assert sorted(names[:3]) == ["s1", "s2", "s3"] and names[3] == "summary"
    assert run.stats.max_batch == 3  # the three summaries decoded together


def test_speculative_example_kills_the_losing_draft(engine) -> None:  # type: ignore[no-untyped-def]
    events, run = _run(engine, (EXAMPLES / "speculative.kvs").read_text(), {"question": "What is 2 + 2?"})
    yields = {e.name: e.value for e in events if e.kind == "yield"}
    loser = "detailed" if yields["route"] == "Brief" else "brief"
    winner = "brief" if loser == "detailed" else "detailed"
    assert winner in yields and loser not in yields
    assert run.stats.killed_branches == [loser]  # it was still running when killed
    assert run.stats.branch_tokens.get(loser, 0) <= 1  # killed as soon as the router decided


def test_kill_stops_decoding_within_one_step(engine) -> None:  # type: ignore[no-untyped-def]
    source = f"""program p() {{
      {SYSTEM}
      user "Write a long story about a dragon."
      story = fork {{ s = gen(max_tokens=200) return s }}
      user "Count from one to ten."
      a = gen(max_tokens=8)
      kill story
      b = gen(max_tokens=4)
      yield a
    }}"""
    events, run = _run(engine, source, {})
    main_tokens = run.stats.branch_tokens["main"]
    story_tokens = run.stats.branch_tokens.get("story", 0)
    assert events[-1].kind == "done"
    assert run.stats.killed_branches == ["story"]  # killed mid-work: it had not finished
    assert 1 <= story_tokens <= 8  # it decoded beside `a` only; none after the kill, none beside `b`
    assert main_tokens >= story_tokens + 3


def test_forks_do_not_recompute_the_parent(engine, lm) -> None:  # type: ignore[no-untyped-def]
    context = _document(1200)
    source = f"""program p(doc) {{
      {SYSTEM}
      user $doc
      answer = gen(max_tokens=16, stop=["\\n"])
      a = fork {{ user "Is this a license? Yes or No." v = select(["Yes", "No"]) return v }}
      b = fork {{ user "Name the license." v = gen(max_tokens=8) return v }}
      wait a, b
      yield answer, a, b
    }}"""
    events, run = _run(engine, source, {"doc": context})
    shared = len(lm.tokenizer.encode(context))
    assert events[-1].kind == "done"
    # The document (and the generated answer) were computed once, not once per branch.
    assert shared < run.stats.prefill_tokens < shared + 150


def test_yields_arrive_in_order_of_readiness(engine) -> None:  # type: ignore[no-untyped-def]
    source = f"""program p() {{
      {SYSTEM}
      user "Tell me about the sea."
      slow = fork {{ s = gen(max_tokens=24) return s }}
      fast = fork {{ s = gen(max_tokens=2) return s }}
      yield slow, fast
    }}"""
    events, _ = _run(engine, source, {})
    assert [e.name for e in events if e.kind == "yield"] == ["fast", "slow"]


def test_same_seed_same_output(engine) -> None:  # type: ignore[no-untyped-def]
    source = f"""program p() {{
      {SYSTEM}
      user "Invent a name for a cat."
      a = gen(max_tokens=12, temperature=1.0, seed=42)
      yield a
    }}"""
    first, _ = _run(engine, source, {})
    second, _ = _run(engine, source, {})
    values = [e.value for e in first if e.kind == "yield"]
    assert len(values) == 1 and values[0]  # a real sample, not two empty runs
    assert values == [e.value for e in second if e.kind == "yield"]


def test_pins_are_released_after_error_and_disconnect(engine, store: TieredStore) -> None:  # type: ignore[no-untyped-def]
    source = (
        f'program p() {{\n  {SYSTEM}\n  user "Hello"\n  a = gen(max_tokens=40)\n  yield a\n'
        "  b = gen(max_tokens=40)\n  yield b\n}"
    )
    events, _ = _run(engine, source, {}, Limits(deadline_s=0.5))
    assert events[-1].kind == "error" and "deadline" in events[-1].value
    assert store.stats().active_leases == 0
    stream = run_program(engine, source, {})
    first = next(stream)
    assert first.kind == "yield" and store.stats().active_leases == 1  # pinned while running
    stream.close()  # the client went away
    assert store.stats().active_leases == 0


def test_run_command_prints_json_lines(tmp_path: Path) -> None:
    program = tmp_path / "hello.kvs"
    program.write_text(f'program hello(name) {{\n  {SYSTEM}\n  user "Say hello to {{name}}."\n'
                       '  a = gen(max_tokens=6)\n  yield a\n}')  # fmt: skip
    cmd = [sys.executable, "-m", "kvstore.cli.main", "run", str(program), "--arg", "name=Ada", "--json",
           "--data-dir", str(tmp_path / "data")]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["kind"] for line in lines] == ["yield", "done"] and lines[0]["name"] == "a"
    bad = subprocess.run([*cmd[:5], "--arg", "nobody=x"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "missing arguments ['name']" in bad.stderr


def test_engine_server_streams_events_and_stops_on_cancel(tmp_path: Path) -> None:
    import time

    import grpc

    from bench.common.sidecar import Sidecar, free_port
    from kvstore._generated.kvsieve.v1 import engine_pb2 as pb
    from kvstore._generated.kvsieve.v1 import engine_pb2_grpc as pb_grpc
    from kvstore.client.kvclient import KVClient

    sidecar = Sidecar(tmp_path / "data").start()
    listen = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "kvstore.cli.main", "engine", "--listen", listen, "--store", sidecar.address]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        channel = grpc.insecure_channel(listen)
        grpc.channel_ready_future(channel).result(timeout=300)
        stub = pb_grpc.EngineStub(channel)
        program = f'program hi(x) {{\n  {SYSTEM}\n  user "Say {{x}}."\n  a = gen(max_tokens=4)\n  yield a\n}}'
        events = list(stub.RunProgram(pb.RunProgramRequest(source=program, args={"x": "hello"}), timeout=300))
        assert [e.kind for e in events] == ["yield", "done"] and json.loads(events[0].value_json)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.RunProgram(pb.RunProgramRequest(source="program x( {", args={}), timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "^" in info.value.details()
        long = (
            f'program long() {{\n  {SYSTEM}\n  user "Tell a story."\n  a = gen(max_tokens=5)\n  yield a\n'
            "  b = gen(max_tokens=400)\n  yield b\n}"
        )
        call = stub.RunProgram(pb.RunProgramRequest(source=long), timeout=300)
        assert next(call).kind == "yield"
        with KVClient(sidecar.address) as client:
            assert client.stats().active_leases == 1  # pinned while it runs
            call.cancel()
            deadline = time.monotonic() + 30
            while client.stats().active_leases and time.monotonic() < deadline:
                time.sleep(0.2)
            assert client.stats().active_leases == 0  # released within a decode step of the cancel
    finally:
        proc.terminate()
        assert proc.wait(30) == 0  # SIGTERM: programs drained, clean exit
        sidecar.kill()


def test_forks_of_the_same_name_in_sibling_forks_stay_apart(engine) -> None:  # type: ignore[no-untyped-def]
    source = f"""program p() {{
      {SYSTEM}
      user "Say one word."
      a = fork {{ h = fork {{ v = select(["Apple"]) return v }} wait h return h }}
      b = fork {{ h = fork {{ v = select(["Banana"]) return v }} wait h return h }}
      wait a, b
      yield a, b
    }}"""
    events, run = _run(engine, source, {})
    yields = {e.name: e.value for e in events if e.kind == "yield"}
    assert events[-1].kind == "done", events[-1]
    assert yields == {"a": "Apple", "b": "Banana"}  # each parent waited on its own child
    assert sorted(b.name for b in run._branches) == ["a", "b", "h", "h", "main"]


def test_an_unforeseen_executor_failure_ends_the_stream_with_one_error(engine, store: TieredStore) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    from engine_adapter.dsl import ops

    # A plan the planner would refuse (b is defined on one path only), run unchecked:
    # the executor must still end with an error event, not raise.
    source = f'program p(a) {{\n  {SYSTEM}\n  user "Hi"\n  if a == "x" {{ b = gen() }}\n  yield b\n}}'
    with pytest.raises(ProgramError, match="yield of unknown name 'b'"):
        plan(source)
    checked = plan(source.replace("yield b", "yield a"))  # then its last op swapped for `yield b`
    branch = checked.body[-2]
    assert isinstance(branch, ops.If) and isinstance(branch.then[0], ops.Gen)
    unchecked = replace(checked, body=(*checked.body[:-1], ops.Yield((branch.then[0].target,))))
    events = list(ProgramRun(engine, unchecked, {"a": "y"}).events())
    assert [e.kind for e in events] == ["error"]
    assert events[0].value == "KeyError: 'b'"
    assert store.stats().active_leases == 0


def test_run_command_reports_a_dead_store_in_one_line(tmp_path: Path) -> None:
    from bench.common.sidecar import free_port

    program = tmp_path / "hello.kvs"
    program.write_text(f'program hello() {{\n  {SYSTEM}\n  user "Hi"\n  a = gen(max_tokens=2)\n  yield a\n}}')
    cmd = [
        sys.executable,
        "-m",
        "kvstore.cli.main",
        "run",
        str(program),
        "--store",
        f"127.0.0.1:{free_port()}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("kvsieve run: error:")]
    assert len(errors) == 1 and "UNAVAILABLE" in errors[0], result.stderr


def _fork(name: str, question: str, tokens: int) -> str:
    return f'{name} = fork {{ user "{question}" s = gen(max_tokens={tokens}) return s }}'


FORKS = [("a", "Name a colour.", 4), ("b", "Name a fruit.", 7), ("c", "Name an animal.", 10)]


def test_batched_forks_answer_as_each_fork_alone_and_leave_the_batch(engine) -> None:  # type: ignore[no-untyped-def]
    forks = "\n".join(_fork(*f) for f in FORKS)
    source = f'program p() {{ {SYSTEM} user "Answer in one word." {forks} wait a, b, c yield a, b, c }}'
    events, run = _run(engine, source, {})
    together = {e.name: e.value for e in events if e.kind == "yield"}
    assert run.stats.max_batch == 3
    # Each row leaves the batch when its answer ends: the batch shrinks as the answers do.
    tokens = run.stats.branch_tokens
    assert run.stats.batch_sizes == [
        sum(tokens[n] > k for n, _, _ in FORKS) for k in range(max(tokens.values()))
    ]
    assert len(set(run.stats.batch_sizes)) > 1 and len(run.batch) == 0
    # One rebuild to enter, one per row leaving while others stay: none per step.
    assert run.batch.stats.rebuilds <= 3 < run.stats.decode_steps
    for fork in FORKS:
        name = fork[0]
        body = f'{SYSTEM} user "Answer in one word." {_fork(*fork)}'
        alone = f"program p() {{ {body} wait {name} yield {name} }}"
        alone_events, alone_run = _run(engine, alone, {})
        assert alone_run.stats.max_batch == 1
        assert together[name] == next(e.value for e in alone_events if e.kind == "yield")


def test_a_killed_branch_leaves_the_batch_at_once(engine) -> None:  # type: ignore[no-untyped-def]
    source = f"""program p() {{
      {SYSTEM}
      user "Write a long story about a dragon."
      story = fork {{ s = gen(max_tokens=200) return s }}
      user "Count from one to ten."
      a = gen(max_tokens=6)
      kill story
      b = gen(max_tokens=4)
      yield a, b
    }}"""
    _, run = _run(engine, source, {})
    story = run.stats.branch_tokens["story"]
    assert run.stats.killed_branches == ["story"]
    # `story` decoded beside `a`, then its row was removed: `b` decodes alone.
    assert run.stats.batch_sizes[:story] == [2] * story
    assert run.stats.batch_sizes[story:] == [1] * (len(run.stats.batch_sizes) - story)
    assert len(run.stats.batch_sizes) > story and len(run.batch) == 0
