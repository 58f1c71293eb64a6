"""GGUF files → local Hugging Face folders, converted once and cached.

A GGUF file (llama.cpp's format) holds a model's weights, mostly quantized into small blocks,
plus its config and tokenizer as key/value metadata. The rest of minivllm only knows how to
load a Hugging Face folder (config.json + model.safetensors + tokenizer files), so a GGUF is
turned into one: every tensor is dequantized to float32, renamed from llama.cpp's names
(`blk.0.attn_q.weight`) to HF's (`model.layers.0.self_attn.q_proj.weight`), and the Q/K rows
that llama.cpp reordered for its RoPE kernel are put back in HF order. `resolve_gguf` does
this once per file and keeps the result in the user's cache folder.

Chapter 06 (Models & operators: weight loading) explains it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

# Only the standard library at import time: the warm path of `resolve_gguf` must stay instant.
if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger("minivllm")

# Bump when the converted output would change; old cache entries are then simply not found.
CONVERTER_VERSION = 2

# llama.cpp architecture → were the Q/K projection rows permuted when the GGUF was written?
# llama.cpp's "llama" graph uses NORM RoPE, which rotates adjacent pairs (x0, x1), (x2, x3), ...
# like Meta's original code; HF's Llama rotates x_i with x_{i+d/2} (rotate_half). So
# convert_hf_to_gguf.py's LlamaModel permutes q_proj/k_proj rows (and biases) from HF order into
# adjacent-pair order. Mistral GGUFs are "llama" too: when converted from Mistral's native
# checkpoint the converter skips the permute only because those rows are already in
# adjacent-pair order, so the file layout is the same. Qwen2/Qwen3 use NEOX RoPE in llama.cpp,
# which is HF's rotate_half: their converter classes never permute, so nothing to undo.
PERMUTED_QK_ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}


def resolve_gguf(gguf_path: str | Path) -> Path:
    """The cached HF folder for `gguf_path`, converting the file the first time it is seen."""
    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    entry = gguf_cache_root() / _cache_key(gguf_path)
    # An entry only ever appears by an atomic rename of a finished folder, so existing == complete.
    if entry.is_dir():
        return entry

    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.partial-", dir=entry.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the finished entry is an ordinary folder
    started = time.perf_counter()
    try:
        convert_gguf_to_hf(gguf_path, staging)
        try:
            os.replace(staging, entry)
        except OSError:
            if not entry.is_dir():
                raise
            # Another process finished the same conversion first; its folder is as good as ours.
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # a no-op once the rename has happened
    logger.info(
        "converting %s once; cached at %s (took %.1f s)",
        gguf_path.name, entry, time.perf_counter() - started,
    )
    return entry


def gguf_cache_root() -> Path:
    """Where converted GGUFs live (in a `gguf` subfolder): $MINIVLLM_CACHE_DIR, else
    $XDG_CACHE_HOME/minivllm, else ~/.cache/minivllm."""
    if root := os.environ.get("MINIVLLM_CACHE_DIR"):
        return Path(root).expanduser() / "gguf"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "minivllm" / "gguf"


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write an HF folder for `gguf_path` into `out_dir`: config, generation config,
    float32 model.safetensors and tokenizer files (with the chat template)."""
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as exc:  # gguf raises bare ValueErrors/struct errors on a bad file
        raise ValueError(f"{gguf_path} is not a readable GGUF file: {exc}") from exc

    architecture = _field(reader, "general.architecture")
    if architecture not in PERMUTED_QK_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {architecture!r} in {gguf_path}; "
            f"minivllm converts {sorted(PERMUTED_QK_ARCHITECTURES)}"
        )
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        # Llama 3.1+ files store their rope scaling as precomputed factors, which
        # transformers' GGUF config does not read back; loading without them is silently wrong.
        raise ValueError(f"{gguf_path}: Llama-3.1-style rope scaling (rope_freqs.weight) is not supported")

    out_dir.mkdir(parents=True, exist_ok=True)
    config = _config_from_gguf(gguf_path, reader, architecture)
    with torch.device("meta"):  # the HF model class, for its parameter names only: no memory
        model = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(model).__name__]  # how minivllm's ModelRegistry picks the model
    config.save_pretrained(out_dir)
    hf_names = _gguf_to_hf_names(model, architecture)

    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        hf_name = hf_names.get(tensor.name)
        if hf_name is None:
            raise ValueError(f"{gguf_path}: no Hugging Face parameter for GGUF tensor {tensor.name!r}")
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if PERMUTED_QK_ARCHITECTURES[architecture]:
            if ".attn_q." in tensor.name:
                weight = unpermute_qk_rows(weight, config.num_attention_heads)
            elif ".attn_k." in tensor.name:
                weight = unpermute_qk_rows(weight, config.num_key_value_heads)
        # copy: F32 tensors come back as views of the memory-mapped file
        tensors[hf_name] = torch.from_numpy(weight.astype("float32", copy=True)).contiguous()

    expected = set(hf_names.values())
    if missing := sorted(expected - tensors.keys()):
        raise ValueError(f"{gguf_path} lacks tensors the {architecture} model needs: {missing}")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    _write_generation_config(reader, config, out_dir)
    _write_tokenizer(gguf_path, out_dir)
    return out_dir


# --8<-- [start:unpermute_qk_rows]
def unpermute_qk_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's RoPE permutation of a Q or K projection (weight or bias).

    Within each head of `head_dim` rows, llama.cpp stored HF row j at row 2j and HF row
    j + head_dim/2 at row 2j+1, so that NORM RoPE's adjacent pairs are HF's rotate_half pairs.
    Reading the head as (head_dim/2, 2) and transposing to (2, head_dim/2) restores HF order.
    `num_heads` is the number of heads of *this* projection (KV heads for K under GQA).
    """
    rows = weight.shape[0]
    half_head_dim = rows // num_heads // 2
    per_head = weight.reshape(num_heads, half_head_dim, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)
# --8<-- [end:unpermute_qk_rows]


def _cache_key(gguf_path: Path) -> str:
    """A folder name that changes whenever the file or the converter does."""
    stat = gguf_path.stat()
    fingerprint = f"{gguf_path.name}|{stat.st_size}|{stat.st_mtime_ns}|v{CONVERTER_VERSION}"
    return f"{gguf_path.stem}-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}"


def _field(reader, key: str, default=None):
    """One metadata value (str, number or list) from a GGUFReader, or `default`."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _config_from_gguf(gguf_path: Path, reader, architecture: str):
    """The HF config, through transformers' GGUF support, plus what it leaves out."""
    import numpy as np
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # transformers maps llama's rope.dimension_count to head_dim, but not qwen3's key_length
    # (Qwen3 heads are wider than hidden_size / num_heads).
    if (key_length := _field(reader, f"{architecture}.attention.key_length")) is not None:
        config.head_dim = int(key_length)
    # GGUF stores eps as float32 (1e-5 reads back as 9.9999997e-06); keep the value the
    # original config.json had, i.e. the shortest decimal that is the same float32.
    config.rms_norm_eps = float(str(np.float32(config.rms_norm_eps)))
    config.dtype = "float32"  # what model.safetensors holds after dequantization
    return config


def _gguf_to_hf_names(model, architecture: str) -> dict[str, str]:
    """GGUF tensor name → HF parameter name, by inverting gguf's own HF→GGUF name map.

    gguf's map knows many spellings of each tensor (one per model family); asking it about
    exactly the parameters of the HF model class picks the right one.
    """
    import gguf

    config = model.config
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture)
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    gguf_to_hf: dict[str, str] = {}
    for hf_name in model.state_dict():
        if config.tie_word_embeddings and hf_name == "lm_head.weight":
            continue  # tied: the file has no output.weight, the loader reuses the embedding
        module, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(module)
        if gguf_name is None:
            raise ValueError(f"gguf's name map for {architecture!r} has no tensor for {hf_name!r}")
        gguf_to_hf[f"{gguf_name}.{suffix}"] = hf_name
    return gguf_to_hf


def _write_generation_config(reader, config, out_dir: Path) -> None:
    """generation_config.json: llama.cpp stops on EOS and also on EOT/EOM tokens when present."""
    from transformers import GenerationConfig

    eos_ids = [config.eos_token_id]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        token_id = _field(reader, key)
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(int(token_id))
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        pad_token_id=getattr(config, "pad_token_id", None),
    ).save_pretrained(out_dir)


def _write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja via transformers' GGUF support.

    PreTrainedTokenizerFast rather than AutoTokenizer: AutoTokenizer first re-reads the whole
    GGUF header to build a config (about 9 s for the demo model) only to pick this same class.
    """
    from transformers import PreTrainedTokenizerFast

    # Byte-level BPE and SentencePiece decode exactly; the WordPiece-era "clean up spaces" step
    # would strip spaces before punctuation, so it is switched off explicitly.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, clean_up_tokenization_spaces=False
    )
    tokenizer.save_pretrained(out_dir)
