"""The emulated engine (``emulated:<profile>``): deterministic tokens that depend on every
token before them, steps that sleep what the profile prices them at, blocks of the
profile's byte size - and, on a real cluster, a workflow whose state mode matches text mode.
"""

import time

import pytest
import torch
from test_relay_prefill import _relayed

from daskflow_kv.engine import Engine
from daskflow_kv.errors import InvalidInputError
from daskflow_kv.model.emulated_forward import EmulatedForward
from daskflow_kv.model.emulated_kv import read_hashes
from daskflow_kv.model.emulated_profile import load_profile, parse, profile_names
from daskflow_kv.model.step_forward import Feed
from daskflow_kv.model.zoo.names import check_model, max_positions

MODEL = "emulated:test-tiny"
DOC = "The shared context is prefilled once and every agent resumes from the same cache. " * 6


@pytest.fixture(scope="module")
def eng():
    return Engine(model=MODEL, block_size=16)


def _profile(**over) -> dict:
    d = {"emulates": "a test", "model": {"layers": 4, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16",
                                         "max_positions": 4096},
         "tokenizer": "tiny-llama", "kv_scale": 1, "step_cost": {"fixed": 0.001}, "sources": [{"what": "test"}]}
    d.update(over)
    return d


def test_tokens_are_a_function_of_every_token_before_them(eng):
    ids = eng.encode(DOC)
    root = eng.materialize(ids[:50])  # ends mid-block: the resume reads the chain from a partial block
    suffixes = [eng.encode(f" Question {i}: what is shared?") for i in range(3)]
    forks = eng.resume_forks(root, [ids[50:] + s for s in suffixes], 8)
    for s, g in zip(suffixes, forks):
        text = eng.generate_text(ids + s, 8)
        assert g.tokens == text.tokens and len(g.tokens) == 8
    assert eng.generate_text(ids + suffixes[0], 8).tokens == forks[0].tokens  # deterministic
    other = eng.materialize(eng.encode(DOC.replace("shared", "private", 1)))
    assert eng.resume(other, suffixes[0], 8).tokens != forks[0].tokens


def test_a_resume_reads_the_chain_from_the_block_bytes(eng):
    ids = eng.encode(DOC)
    root = eng.materialize(ids[:64])
    blocks = [eng.store.get(b.key).clone() for b in root.blocks]
    rn = eng.runner
    right = rn.run(blocks, 64, ids[64:80], 6, export=False).generated
    assert right == rn.run([], 0, ids[:80], 6, export=False).generated
    blocks[-1][0, 0, 0, -1].view(torch.int32)[0] += 1  # one bit of the last position's chain value
    assert rn.run(blocks, 64, ids[64:80], 6, export=False).generated != right


def test_a_step_sleeps_what_the_profile_prices_its_shape_at(eng):
    fw = EmulatedForward(eng.runner)
    p = load_profile(MODEL)
    lanes = [fw.open([], 0, 200) for _ in range(3)]
    t0 = time.perf_counter()
    fw.run([Feed(lanes[0], list(range(1, 101)), True)])
    took = time.perf_counter() - t0
    c = p.cost
    priced = c.fixed + c.prompt_fixed + 100 * c.per_prompt_token + c.per_attn * 100 * 50 + 3 * c.per_join
    assert p.seconds({"prompt_tokens": 100, "prompt_attn": 5000.0, "joined": 3}) == pytest.approx(priced)
    assert priced <= took < priced + 0.02
    t0 = time.perf_counter()
    fw.run([Feed(lanes[0], [5], True), Feed(lanes[1], list(range(1, 41)), False)])  # a decode row beside a prompt chunk
    took = time.perf_counter() - t0
    priced = p.seconds({"prompt_tokens": 40, "prompt_attn": 40 * 20.0, "decode_rows": 1, "decode_keys": 100})
    assert priced <= took < priced + 0.02


def test_a_token_curve_prices_the_dense_work_by_tokens_fed():
    p = parse("t", _profile(step_cost={"fixed": 0.001}, token_curve=[[1, 0.005], [100, 0.005], [1100, 0.015]]))
    assert p.seconds({"decode_rows": 1}) == pytest.approx(0.006)
    assert p.seconds({"decode_rows": 60}) == pytest.approx(0.006)  # flat: the weights are read once
    assert p.seconds({"prompt_tokens": 600}) == pytest.approx(0.011)
    assert p.seconds({"prompt_tokens": 2100}) == pytest.approx(0.026)  # past the last point: its slope


def test_blocks_hold_the_profile_bytes_scaled_only_as_it_says(eng):
    ids = eng.encode(DOC)
    out = eng.runner.run([], 0, ids[:40], 0)
    p = load_profile(MODEL)
    assert [(s, e) for s, e, _ in out.new_blocks] == [(0, 16), (16, 32), (32, 40)]
    for s, e, b in out.new_blocks:
        assert b.nbytes == (e - s) * p.bytes_per_token == (e - s) * p.emulated_bytes_per_token
    big = parse("big", _profile(kv_scale=32))
    assert big.emulated_bytes_per_token == 4 * 2 * 8 * 128 * 2
    assert big.bytes_per_token * 32 == big.emulated_bytes_per_token and big.stored_heads == (1, 32)
    assert "EMULATED big" in big.label and "1/32" in big.label


def test_relayed_chunks_continue_the_chain_of_the_earlier_ones(eng):
    ids = eng.encode(DOC)[:90]
    rn = eng.runner
    blocks = _relayed(rn, ids, [(0, 32), (32, 64), (64, 90)])  # block-aligned, as the runtime cuts them
    whole = rn.run([], 0, ids, 0).new_blocks
    assert [(s, e) for s, e, _ in blocks] == [(s, e) for s, e, _ in whole]
    for (_, _, a), (_, _, b) in zip(blocks, whole):
        assert read_hashes(a[0, 0, 0]) == read_hashes(b[0, 0, 0])  # the chain values; the rest is filler
    tail = eng.encode(" And the answer?")
    assert rn.run([b for *_, b in blocks], 90, tail, 6).generated == rn.run([], 0, ids + tail, 6).generated


def test_bad_names_and_profiles_fail_with_one_line():
    assert "test-tiny" in profile_names() and check_model(MODEL) == MODEL and max_positions(MODEL) == 2048
    with pytest.raises(InvalidInputError, match="no emulated profile 'nope'; known: .*test-tiny"):
        check_model("emulated:nope")
    with pytest.raises(InvalidInputError, match="kv_scale"):
        parse("t", _profile(kv_scale=3))
    with pytest.raises(InvalidInputError, match="sources"):
        parse("t", _profile(sources=[]))
    with pytest.raises(InvalidInputError, match="token_curve"):
        parse("t", _profile(step_cost={"per_row": 1e-4}, token_curve=[[1, 0.1], [8, 0.2]]))


def test_a_workflow_on_emulated_workers_matches_text_mode():
    """Two emulated worker processes: the real runtime, state mode token for token with text mode."""
    from daskflow_kv import Workflow
    from daskflow_kv.runtime.cluster import embedded_runtime

    wf = Workflow("emulated", system="You are a careful analyst.")
    wf.context("report", DOC)
    wf.agent("optimist", "List the strengths.", reads=["report"], max_new_tokens=6)
    wf.agent("skeptic", "List the weaknesses.", reads=["report"], max_new_tokens=6)
    wf.agent("judge", "Weigh both views.", reads=["report", "optimist", "skeptic"], merge="text", max_new_tokens=6)
    wf.agent("judge2", "Say it shorter.", follows="judge", max_new_tokens=6)
    with embedded_runtime(n_workers=2, model=MODEL, block_size=16) as rt:
        assert rt.facts.bytes_per_token == load_profile(MODEL).bytes_per_token
        result = wf.run(mode="both", runtime=rt)
    assert result.agreement == {"optimist": True, "skeptic": True, "judge": True, "judge2": True}
    assert result.state.agents["judge2"].tokens_reused > 0


def test_the_cli_says_emulated_and_names_the_profile(tmp_path, capsys):
    import json

    from daskflow_kv.cli import main as cli_main

    out = tmp_path / "run.json"
    assert cli_main(["run", "debate", "--model", MODEL, "--workers", "1", "--agents", "2", "--rounds", "1",
                     "--mode", "text", "--json", str(out)]) == 0  # (state mode beside it: the workflow test above)
    label = load_profile(MODEL).label
    assert label.startswith("EMULATED test-tiny") and label in capsys.readouterr().out
    assert json.loads(out.read_text())["emulated"] == label


def test_a_bench_run_records_the_profile_it_emulated():
    from daskflow_kv.bench.run import emulated_label

    doc = {"model": {"dtype": "bfloat16"}}
    assert emulated_label("tiny-llama", doc) is None and "emulated" not in doc["model"]
    assert emulated_label(MODEL, doc) == load_profile(MODEL).label
    rec = doc["model"]["emulated"]
    assert rec["profile"] == "test-tiny" and rec["sources"] and doc["model"]["dtype"] == "float32"
