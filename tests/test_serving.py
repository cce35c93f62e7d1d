"""Serving through JetStream (the optional "serve" extra): the engine adapter under JetStream's own engine
test patterns, the driver under JetStream's orchestrator test patterns (with JetStream's mock engine and
with ours), and a gRPC request to launch/serve.py against jaxrl-generate.

Skipped where jetstream is not installed (the main environment). To run them (what .ci/run does):
  python3 -m venv .venv-serve && .venv-serve/bin/pip install -e ".[serve]" "pytest>=8,<10"
  .venv-serve/bin/python -m pytest -q tests/test_serving.py
"""

import asyncio
import logging
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("jetstream.engine.engine_api", reason='needs the serve extra: pip install -e ".[serve]"')

import grpc  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jetstream.core import orchestrator  # noqa: E402
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # noqa: E402
from jetstream.engine import engine_api, mock_engine  # noqa: E402

from jaxrl_async.model import forward_logits, init_params, presets, save_hf  # noqa: E402
from jaxrl_async.sampler import Engine, SamplerConfig  # noqa: E402
from jaxrl_async.serving.driver import EngineDriver  # noqa: E402
from jaxrl_async.serving.jetstream_engine import JetStreamEngine  # noqa: E402
from jaxrl_async.sharding import SAMPLER_RULES, make_mesh  # noqa: E402
from jaxrl_async.tokenizer import CharTokenizer  # noqa: E402

# Importing jetstream.core.orchestrator sets the root logger to DEBUG, with a handler on the stdout that
# pytest captures (and closes before jax's exit-time debug messages).
logging.getLogger().setLevel(logging.WARNING)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = CharTokenizer()
TINY = presets.tiny(vocab_size=TOK.vocab_size, n_layers=2, max_seq_len=64, qkv_bias=True, qk_norm=True)
MESH1 = make_mesh((1, 1), ("data", "tensor"), jax.devices()[:1])


def _params(seed=0, mesh=MESH1):
    params = init_params(TINY, jax.random.key(seed), mesh, SAMPLER_RULES)
    # Random init keeps logits near-uniform; sharpen them so greedy comparisons are meaningful.
    return jax.tree.map(lambda x: x * 1.5 if x.ndim >= 2 else x, params)


def _greedy_reference(params, prompt, n, stop=()):
    """Greedy tokens by full forwards (the trainer's model), without the stop token."""
    seq = list(prompt)
    for _ in range(n):
        padded = np.zeros((1, 48), np.int32)
        padded[0, : len(seq)] = seq
        tok = int(np.asarray(forward_logits(TINY, params, padded)[0, len(seq) - 1]).argmax())
        if tok in stop:
            break
        seq.append(tok)
    return seq[len(prompt) :]


def _adapter(params, mesh=MESH1, **kw):
    base = dict(num_slots=4, max_prompt_len=16, max_new_tokens=16, steps_per_call=1, temperature=0.0)
    base.update(kw)
    return JetStreamEngine(Engine(TINY, params, mesh, SamplerConfig(**base)), "char")


@pytest.fixture(scope="module")
def params():
    return _params()


@pytest.mark.parametrize("mesh_shape", [(1, 1), (2, 2)])
def test_engine_api_prefill_insert_generate(params, mesh_shape):
    # JetStream's mock-engine test, on our engine: load_params, tokenizer from get_tokenizer, prefill,
    # insert into a slot, generate step by step and read the slot's tokens; a second request inserted
    # while the first decodes gets its own greedy tokens too.
    mesh = make_mesh(mesh_shape, ("data", "tensor"), jax.devices()[: mesh_shape[0] * mesh_shape[1]])
    engine = _adapter(_params(mesh=mesh), mesh)  # the same values, sharded over `mesh`
    assert isinstance(engine, engine_api.Engine)
    assert (engine.max_concurrent_decodes, engine.samples_per_slot, engine.max_prefill_length) == (4, 1, 16)
    assert engine.mesh is mesh and engine.colocated_cpus is None
    weights = engine.load_params()
    tokenizer = engine.build_tokenizer(engine.get_tokenizer())
    first, second = "12+34=", "7*8="
    tokens, true_length = tokenizer.encode(first, is_bos=True)
    assert true_length == len(first) and tokens.shape == (16,)  # no BOS for the char tokenizer; bucket 16
    assert tokenizer.decode(np.asarray(tokens[:true_length]).tolist()) == first
    state = engine.init_decode_state()
    state = engine.insert(
        engine.prefill(params=weights, padded_tokens=tokens, true_length=true_length), state, 1
    )
    got = {1: [], 3: []}
    for step in range(8):
        if step == 3:
            tokens2, len2 = tokenizer.encode(second, is_bos=True)
            prefix = engine.prefill(params=weights, padded_tokens=tokens2, true_length=len2)
            state = engine.insert(prefix, state, 3)
        state, result = engine.generate(weights, state)
        result = result.convert_to_numpy()
        for slot in got:
            data = result.get_result_at_slot(slot)
            assert data.tokens.shape == (1, 1) and data.valid.shape == (1, 1)
            live = slot == 1 or step >= 3
            assert bool(data.valid[0, 0]) == live
            assert int(data.lengths[0]) == (step + 1 if slot == 1 else max(0, step - 2))
            if live:
                got[slot].append(int(data.tokens[0, 0]))
        assert not result.get_result_at_slot(0).valid.any()  # a free slot produces nothing
    assert got[1] == _greedy_reference(params, TOK.encode(first), 8)
    assert got[3] == _greedy_reference(params, TOK.encode(second), 5)


def test_engine_weights_handle_and_errors(params):
    engine = _adapter(params)
    old = engine.load_params()
    new_params = _params(seed=1)
    new = engine.load_params(new_params)
    assert new.version == old.version + 1
    tokenizer = engine.build_tokenizer(engine.get_tokenizer())
    tokens, n = tokenizer.encode("5-3=", is_bos=True)
    with pytest.raises(ValueError, match="not this engine's weights"):
        engine.prefill(params=old, padded_tokens=tokens, true_length=n)
    state = engine.insert(
        engine.prefill(params=new, padded_tokens=tokens, true_length=n), engine.init_decode_state(), 0
    )
    out = []
    for _ in range(4):
        state, result = engine.generate(new, state)
        out.append(int(result.convert_to_numpy().get_result_at_slot(0).tokens[0, 0]))
    assert out == _greedy_reference(new_params, TOK.encode("5-3="), 4)  # the swapped-in weights decode
    with pytest.raises(NotImplementedError, match="existing_prefix"):
        engine.prefill(params=new, existing_prefix=object(), padded_tokens=tokens, true_length=n)
    with pytest.raises(ValueError, match="exceeds the server's max prompt length 16"):
        tokenizer.encode("1" * 17)
    with pytest.raises(ValueError, match="steps_per_call=4"):
        _adapter(params, steps_per_call=4)


async def _decode(client, max_tokens, text=None, ids=None):
    """(texts, token ids) of each streamed response of one Decode call, as JetStream's tests read them."""
    if text is not None:
        content = dict(text_content=jetstream_pb2.DecodeRequest.TextContent(text=text))
    else:
        content = dict(token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=ids))
    request = jetstream_pb2.DecodeRequest(max_tokens=max_tokens, **content)

    async def read():
        texts, tokens = [], []
        async for resp in client.Decode(request):
            sample = resp.stream_content.samples[0]
            texts.append(sample.text)
            tokens.append(list(sample.token_ids))
        return texts, tokens

    return await asyncio.wait_for(read(), timeout=120)


def _mock_engine_orchestrator_check() -> None:
    """JetStream's orchestrator test on JetStream's own mock engine (weight 2; its mock-engine test's
    figures: prefill [2, 65, 66] -> 266, then 399, 598), through JetStream's servicer and our driver."""
    engine = mock_engine.TestEngine(batch_size=4, cache_length=32, weight=2.0)
    driver = EngineDriver(engine)
    client = orchestrator.LLMOrchestrator(driver=driver)

    async def run():
        # Client-side tokenization: ids as given (BOS 2 included by the client), ids back, no text.
        return await _decode(client, 3, text="AB"), await _decode(client, 3, ids=[2, 65, 66])

    try:
        (texts, tokens), (id_texts, id_tokens) = asyncio.run(run())
    finally:
        driver.stop()
    assert texts == ["Ċ", "Ə", "ɖ", ""] and tokens == [[266], [399], [598], []], (texts, tokens)
    assert id_texts == ["", "", "", ""] and id_tokens == tokens, (id_texts, id_tokens)


def test_driver_with_jetstream_mock_engine():
    # The mock engine lays its mesh over all of jax.devices() as (1, 1, 1), so it needs a process that
    # sees one device (this one sees 8 fake ones).
    code = "import test_serving; test_serving._mock_engine_orchestrator_check(); print('mock engine ok')"
    env = dict(_env(), PYTHONPATH=f"{REPO}:{REPO}/tests")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0 and "mock engine ok" in res.stdout, res.stderr[-4000:]


def test_driver_serves_our_engine(params):
    # More requests than slots, at once, with different lengths and both input kinds: each gets its own
    # greedy tokens, at most the engine's max_new_tokens (16) even when it asks for more; a request that
    # cannot be served fails alone and the server goes on.
    eos = TOK.eos_id
    driver = EngineDriver(_adapter(params, num_slots=2, stop_tokens=(eos,)))
    client = orchestrator.LLMOrchestrator(driver=driver)
    prompts = ["12+34=", "9*9=", "3", "(1+2)*3=", "40/5=", "1+1="]
    limits = [6, 3, 40, 6, 1, 2]  # "(1+2)*3=" stops at EOS after 4 tokens, "3" would run for 40

    async def run():
        jobs = [_decode(client, n, text=p) for p, n in zip(prompts[:-1], limits, strict=False)]
        jobs.append(_decode(client, 4, ids=TOK.encode("77-7=")))
        results = await asyncio.gather(*jobs)
        with pytest.raises(ValueError, match="max prompt length 16"):
            await _decode(client, 2, text="1" * 20)
        with pytest.raises(ValueError, match="the server takes 1 to 16 tokens"):
            await _decode(client, 2, ids=[5] * 17)
        assert driver.live
        results.insert(-1, await _decode(client, limits[-1], text=prompts[-1]))
        health = await client.HealthCheck(jetstream_pb2.HealthCheckRequest())
        return results, health

    try:
        results, health = asyncio.run(run())
    finally:
        driver.stop()
    assert health.is_live and not driver.live
    for (texts, tokens), prompt, n in zip(results, [*prompts, "77-7="], [*limits, 4], strict=True):
        ref = _greedy_reference(params, TOK.encode(prompt), min(n, 16), stop=(eos,))
        assert [t for step in tokens for t in step] == ref, prompt
        assert "".join(texts) == ("" if prompt == "77-7=" else TOK.decode(ref))  # ids in, ids out
        assert len(tokens) == len(ref) + 1  # a token per step, then the end of the stream


def _generate_cli(ckpt, prompt, n):
    cmd = [sys.executable, "-m", "jaxrl_async.cli.generate", "--checkpoint", ckpt]
    cmd += ["--tokenizer", "char", "--prompt", prompt, "--max-new-tokens", str(n), "--temperature", "0"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env())
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("--- sample 0"))
    ids = [int(t) for t in lines[head + 2].removeprefix("ids: ").split()]
    return lines[head + 1], ids


def _env():
    return dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")


def test_grpc_server_returns_the_generate_cli_text(tmp_path):
    # A tiny Hugging Face checkpoint, served by launch/serve.py on localhost; a gRPC Decode request gets
    # the text (and ids) that jaxrl-generate prints for the same prompt.
    cfg = presets.tiny(vocab_size=TOK.vocab_size, n_layers=1, max_seq_len=64)
    ckpt = str(tmp_path / "ckpt")
    save_hf(cfg, init_params(cfg, jax.random.key(3)), ckpt)
    prompt, n = "12+34=", 12
    cli_text, cli_ids = _generate_cli(ckpt, prompt, n)
    cmd = [sys.executable, os.path.join(REPO, "launch", "serve.py"), "--checkpoint", ckpt]
    cmd += ["--tokenizer", "char", "--port", "0", "--num-slots", "2", "--max-prompt-len", "16"]
    cmd += ["--max-new-tokens", "32"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        for line in server.stdout:  # until the server is up (or has exited)
            if line.startswith("listening on localhost:"):
                break
        assert server.poll() is None, server.stderr.read()[-4000:]
        port = int(line.strip().rsplit(":", 1)[1])
        with grpc.insecure_channel(f"localhost:{port}") as channel:
            stub = jetstream_pb2_grpc.OrchestratorStub(channel)
            assert stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=60).is_live
            request = jetstream_pb2.DecodeRequest(
                text_content=jetstream_pb2.DecodeRequest.TextContent(text=prompt), max_tokens=n
            )
            samples = [r.stream_content.samples[0] for r in stub.Decode(request, timeout=120)]
            text = "".join(s.text for s in samples)
            ids = [t for s in samples for t in s.token_ids]
            too_long = jetstream_pb2.DecodeRequest(
                text_content=jetstream_pb2.DecodeRequest.TextContent(text="1" * 17), max_tokens=2
            )
            with pytest.raises(grpc.RpcError, match="max prompt length 16"):
                list(stub.Decode(too_long, timeout=60))
        assert text == cli_text
        # generate.py's ids keep the stop token; the server ends the stream before it.
        assert ids == (cli_ids[:-1] if cli_ids[-1:] == [TOK.eos_id] else cli_ids)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
