"""Stage 1 for one .gguf file: the same Checkpoint load_hf_folder returns, built from llama.cpp's format.

A GGUF holds the config, the tokenizer and the chat template as metadata under llama.cpp's key names,
and the tensors under llama.cpp's names, some rewritten by its converter (convert_hf_to_gguf.py). Here
all of that is turned back into what the Hugging Face checkpoint would have held, so the families
(impc/families) never know which format they read:
- names: blk.N.attn_q.weight -> model.layers.N.self_attn.q_proj.weight, ...;
- llama: the converter permutes the rows of attn_q/attn_k (HF's rotate-half RoPE -> llama.cpp's
  interleaved pairs); undone here exactly as transformers undoes it when it loads a GGUF;
- gemma3: the converter stores every `*norm.weight` as 1 + w (llama.cpp multiplies by the stored
  value; Gemma3RMSNorm multiplies by 1 + w); undone here (w = stored - 1), as transformers does;
- llama-3 RoPE scaling: stored as a `rope_freqs` tensor of per-frequency factors rather than as
  parameters; the HF rope_scaling dict is recovered and checked against that tensor.
The tokenizer is rebuilt as a `tokenizers.Tokenizer` the way transformers' GGUF converter builds it,
except where llama.cpp (the reference for a GGUF) splits text differently: see _PRE_SPLITS.
Tensors stay memory-mapped and are dequantized one at a time, on demand: Q4_1 and Q8_0 here (the
same float32 bits as gguf.quants, ~4x faster), every other type by gguf.quants.dequantize.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from impc.checkpoint import Checkpoint
from impc.errors import CompileError

SUPPORTED = ("gemma3", "llama", "qwen2", "qwen3")   # general.architecture values (mistral is "llama")

# GGUF per-layer leaf name -> HF leaf name (under model.layers.N.).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 has four norms per layer; llama.cpp's ffn_norm is the *pre*-feedforward one there.
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                       "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# tokenizer.ggml.pre -> the regex llama.cpp splits text with before byte-level BPE (llama-vocab.cpp);
# the regexes are those of the models' own tokenizer.json files. Unknown values fall back to GPT-2's.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# StarCoder-style vocabularies (SmolLM2 included) first isolate every digit, then apply GPT-2's regex.
# transformers' GGUF converter skips the digit split; that only matters for a digit right after a run
# of spaces ("a  1": here a|ĠĠ|1 as in llama.cpp and SmolLM2's tokenizer.json; transformers a|Ġ|Ġ|1).
_DIGITS = r"\p{N}"
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "smaug-bpe", "dbrx"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2),
    "tekken": _TEKKEN,
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), _DIGITS),
}
# Control tokens llama.cpp also treats as end of generation (llama-vocab.cpp's EOG heuristic): chat
# models end a turn with these even where tokenizer.ggml.eos_token_id names another token.
_EOG_STRINGS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                "<EOT>", "<|end▁of▁sentence|>")


def load_gguf(path: Path) -> Checkpoint:
    import gguf

    path = Path(path)
    try:
        reader = type("_Reader", (gguf.GGUFReader,), {"_get": _fast_get, "_get_field_parts": _fast_field_parts})(path, "r")
    except Exception as e:                    # bad magic, truncated file, unknown version ...
        raise CompileError(f"{path}: not a readable GGUF file ({e})") from None
    meta = _Metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED:
        raise CompileError(f"{path.name}: unsupported GGUF architecture '{arch}' "
                           f"(supported: {', '.join(SUPPORTED)}; mistral GGUFs say 'llama')")
    by_name = {t.name: t for t in reader.tensors}
    config = _config(arch, meta, by_name)

    # HF name -> (GGUF tensor, what to undo). rope_freqs is not a weight: _config read it.
    layer_names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    plan: dict[str, tuple] = {}
    for name, t in by_name.items():
        stem, _, suffix = name.rpartition(".")            # suffix: weight | bias
        parts = stem.split(".")
        if stem == "rope_freqs":
            continue
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
            hf = f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
        elif stem in _GLOBAL_NAMES:
            hf = f"{_GLOBAL_NAMES[stem]}.{suffix}"
        else:
            raise CompileError(f"{path.name}: tensor '{name}' has no Hugging Face counterpart for {arch} "
                               "(mixture-of-experts and multimodal GGUFs are not supported)")
        undo = None
        if arch == "llama" and parts[-1] in ("attn_q", "attn_k"):
            undo = ("permute", config["num_attention_heads"] if parts[-1] == "attn_q"
                    else config["num_key_value_heads"])
        elif arch == "gemma3" and name.endswith("norm.weight"):
            undo = ("minus_one",)
        plan[hf] = (t, undo)

    def read(hf_name: str) -> np.ndarray:
        t, undo = plan[hf_name]
        # GGUF lists dimensions innermost first; numpy wants them outermost first.
        shape = tuple(int(d) for d in reversed(t.shape))
        try:
            fast = _DEQUANTIZE.get(t.tensor_type.name)
            if fast is not None:
                w = fast(t.data).reshape(shape)
            else:
                w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        except NotImplementedError:
            raise CompileError(f"{path.name}: tensor '{t.name}' is of type {t.tensor_type.name}, which the "
                               "gguf package cannot dequantize") from None
        if undo and undo[0] == "permute":
            w = _unpermute(w, undo[1])
        elif undo and undo[0] == "minus_one":
            w = w - np.float32(1.0)
        return w

    tok = _tokenizer(arch, meta)
    return Checkpoint(path=path, config=config, tokenizer_json=tok["json"], chat_template=tok["chat_template"],
                      special_tokens=tok["special"], eos_token_ids=tok["eos_ids"],
                      generation_config=_generation_config(meta, tok), tensor_names=sorted(plan), read=read,
                      files=[path], add_bos=tok["add_bos"])


def _dequantize_q4_1(data: np.ndarray) -> np.ndarray:
    """Q4_1 blocks (f16 d, f16 m, 16 bytes of nibbles: the low nibbles are elements 0-15, the high 16-31)
    -> float32 d * q + m, the same two float32 roundings as gguf.quants.Q4_1 (which splits the work
    into row groups and Python lists: ~3x the time for SmolLM2's 210 Q4_1 tensors)."""
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)          # [B, 1]
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:]
    out = np.empty((blocks.shape[0], 32), dtype=np.float32)
    np.bitwise_and(qs, np.uint8(0x0F), out=out[:, :16], casting="unsafe")
    np.right_shift(qs, np.uint8(4), out=out[:, 16:], casting="unsafe")
    out *= d
    out += m
    return out


def _dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """Q8_0 blocks (f16 d, 32 int8) -> float32 x * d, as gguf.quants.Q8_0."""
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, 34)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    out = blocks[:, 2:].view(np.int8).astype(np.float32)
    out *= d
    return out


_DEQUANTIZE = {"Q4_1": _dequantize_q4_1, "Q8_0": _dequantize_q8_0}


def _plain(reader) -> np.ndarray:
    """A plain-ndarray view of the reader's np.memmap (made once)."""
    plain = reader.__dict__.get("_plain")
    if plain is None:
        plain = reader._plain = reader.data.view(np.ndarray)
    return plain


def _fast_get(self, offset, dtype, count=1, override_order=None):
    """GGUFReader._get slicing a plain-ndarray view of the reader's np.memmap: the same mapped bytes
    (nothing is read into memory), without np.memmap's per-slice bookkeeping, which made parsing
    the header (one slice per vocabulary string) take 2+ s for SmolLM2's 49k tokens instead of 0.7."""
    plain = _plain(self)
    count = int(count)
    arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
    return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def _fast_field_parts(self, orig_offs: int, raw_type: int):
    """GGUFReader._get_field_parts, an array of numbers as one part and an array of strings by a plain
    loop over the mapped bytes (each string a memoryview of them): the reader's element-by-element
    recursion took ~1.4 s for SmolLM2's 49k tokens, their types and 48k merges, this ~0.1 s. The
    parts hold the same values (_Metadata reads them); anything else goes to the reader's own."""
    import gguf
    from gguf import GGUFValueType as T

    if raw_type != T.ARRAY or self.byte_order != "I":
        return gguf.GGUFReader._get_field_parts(self, orig_offs, raw_type)
    raw_itype = self._get(orig_offs, np.uint32)
    alen = self._get(orig_offs + 4, np.uint64)
    n, offs, itype = int(alen[0]), orig_offs + 12, int(raw_itype[0])
    if n == 0:
        return 12, [raw_itype, alen], [], [T.ARRAY]
    if itype == T.STRING:
        buf = memoryview(_plain(self))
        parts: list = [raw_itype, alen]
        for _ in range(n):
            end = offs + 8 + int.from_bytes(buf[offs:offs + 8], sys.byteorder)
            parts.append(buf[offs + 8:end])
            offs = end
        return offs - orig_offs, parts, list(range(2, 2 + n)), [T.ARRAY, T.STRING]
    nptype = self.gguf_scalar_to_np.get(T(itype))
    if nptype is None:                              # arrays of arrays
        return gguf.GGUFReader._get_field_parts(self, orig_offs, raw_type)
    values = self._get(offs, nptype, n)
    return 12 + int(values.nbytes), [raw_itype, alen, values], [2], [T.ARRAY, T(itype)]


class _Metadata:
    """GGUF key/value metadata as Python values. Strings are decoded leniently: some SentencePiece
    vocabularies hold pieces that are not valid UTF-8 on their own."""

    def __init__(self, reader):
        self.fields = reader.fields

    def get(self, key: str, default=None):
        from gguf import GGUFValueType as T
        f = self.fields.get(key)
        if f is None or not f.types:
            return default
        text = lambda part: part.tobytes().decode("utf-8", errors="replace")  # noqa: E731
        if f.types[0] == T.ARRAY:
            if f.types[-1] == T.STRING:
                return [text(f.parts[i]) for i in f.data]
            return [v for i in f.data for v in f.parts[i].tolist()]
        if f.types[0] == T.STRING:
            return text(f.parts[-1])
        if f.types[0] == T.FLOAT32:   # 1e-5 rather than 9.999999747378752e-06: the value HF wrote
            return float(str(f.parts[-1][0]))
        return f.parts[-1].tolist()[0]


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's LlamaModel.permute: it regroups each head's rows from (2, d/2) halves
    (HF's rotate-half layout) to (d/2, 2) pairs (llama.cpp's interleaved RoPE). Same as transformers'
    LlamaTensorProcessor._reverse_permute_weights; works for weights [rows, in] and biases [rows]."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(arch: str, meta: _Metadata, tensors: dict) -> dict:
    def k(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    hidden, heads, layers = k("embedding_length"), k("attention.head_count"), k("block_count")
    for key in ("embedding_length", "attention.head_count", "block_count", "feed_forward_length"):
        if k(key) is None:
            raise CompileError(f"GGUF metadata lacks {arch}.{key}")
    kv = k("attention.head_count_kv", heads)
    if isinstance(kv, list):              # a per-layer list in some files; fine only if uniform
        if len(set(kv)) != 1:
            raise CompileError(f"GGUF gives a different KV head count per layer ({sorted(set(kv))})")
        kv = kv[0]
    # key_length where written; llama files carry the head size as the RoPE width instead.
    head_dim = k("attention.key_length") or (k("rope.dimension_count") if arch == "llama" else None) \
        or hidden // heads
    name = (meta.get("general.name") or meta.get("general.basename") or "").lower()
    model_type = {"gemma3": "gemma3_text"}.get(arch, arch)
    if arch == "llama" and "mistral" in name:   # llama.cpp has no mistral arch; transformers guesses too
        model_type = "mistral"
    emb = tensors.get("token_embd.weight")
    c = {
        "model_type": model_type,
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "gemma3_text": "Gemma3ForCausalLM"}[model_type]],
        # the embedding's rows are the model's vocabulary, whatever tokenizer.ggml.tokens holds
        "vocab_size": int(emb.shape[1]) if emb is not None else len(meta.get("tokenizer.ggml.tokens", [])),
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "intermediate_size": k("feed_forward_length"),
        "rms_norm_eps": float(k("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(k("rope.freq_base", 10000.0)),
        "max_position_embeddings": k("context_length", 4096),
        # llama.cpp writes output.weight only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if model_type == "mistral":
        c["sliding_window"] = k("attention.sliding_window")
    if arch == "qwen2":                       # HF's Qwen2 keeps sliding attention off by default
        c["use_sliding_window"], c["sliding_window"] = False, None

    rope_type = k("rope.scaling.type")
    if rope_type and rope_type != "none":
        rs = {"rope_type": rope_type, "factor": float(k("rope.scaling.factor", 1.0))}
        if k("rope.scaling.original_context_length"):
            rs["original_max_position_embeddings"] = k("rope.scaling.original_context_length")
        for g, h in (("attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                     ("yarn_beta_slow", "beta_slow")):
            if k(f"rope.scaling.{g}") is not None:
                rs[h] = float(k(f"rope.scaling.{g}"))
        c["rope_scaling"] = rs
    if "rope_freqs.weight" in tensors:
        c["rope_scaling"] = _llama3_rope_scaling(tensors["rope_freqs.weight"], c["rope_theta"],
                                                 k("rope.dimension_count") or head_dim)

    if arch == "gemma3":
        c["hidden_activation"] = "gelu_pytorch_tanh"
        c["sliding_window"] = k("attention.sliding_window")
        # llama.cpp hard-codes these for gemma3 (llama-model.cpp): every 6th layer global, local RoPE
        # base 10000, and the query scale 1/sqrt(head_dim) except the 27B's 1/sqrt(hidden/heads).
        pattern = k("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):        # newer files: one bool per layer, true = sliding
            c["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
        else:
            c["sliding_window_pattern"] = pattern
            c["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                for i in range(layers)]
        c["rope_local_base_freq"] = 10000.0
        c["query_pre_attn_scalar"] = hidden // heads if layers == 62 else head_dim
        c["final_logit_softcapping"] = k("final_logit_softcapping")
        c["attn_logit_softcapping"] = k("attn_logit_softcapping")
    return c


def _llama3_rope_scaling(t, theta: float, dim: int) -> dict:
    """llama.cpp stores Llama-3.1's RoPE scaling only as the per-frequency factors it computes from it
    (LlamaModel.generate_extra_tensors). Every released Llama 3.x uses low 1, high 4, original context
    8192; take the factor from the tensor and check that these parameters reproduce it exactly."""
    import gguf
    stored = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
    rs = {"rope_type": "llama3", "factor": float(stored.max()), "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    expect = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < 8192 / 4.0:
            expect.append(1.0)
        elif wavelen > 8192 / 1.0:
            expect.append(rs["factor"])
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            expect.append(1 / ((1 - smooth) / rs["factor"] + smooth))
    if stored.shape != (dim // 2,) or not np.allclose(stored, expect, rtol=1e-4):
        raise CompileError("GGUF rope_freqs tensor does not match Llama-3 RoPE scaling "
                           "(low_freq_factor 1, high_freq_factor 4, original context 8192)")
    return rs


# --------------------------------------------------------------------------- tokenizer

def _tokenizer(arch: str, meta: _Metadata) -> dict:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not tokens:
        raise CompileError("GGUF has no tokenizer (tokenizer.ggml.tokens is missing)")
    merges = meta.get("tokenizer.ggml.merges")

    def tok_at(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    if kind == "gpt2":
        # Byte-level BPE. A token outside the byte alphabet is a mislabelled added token: respell it.
        alphabet = _bytes_to_unicode()
        letters = set(alphabet.values())
        vocab = {t if set(t) <= letters else "".join(alphabet[b] for b in t.encode()): i
                 for i, t in enumerate(tokens)}
        tk = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges or []],
                                  continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
        split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split in (None, _DIGITS))
        tk.pre_tokenizer = byte_level if split is None else pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
        tk.decoder = decoders.ByteLevel()
        control_ok = lambda t: set(t) <= letters  # noqa: E731  (else it would grow the vocabulary)
    elif kind == "llama":
        # SentencePiece vocabulary, run as BPE with byte fallback (<0xNN> pieces) like transformers'
        # LlamaTokenizer / GemmaTokenizer. Without merges in the file they are rebuilt from the vocab.
        if arch == "gemma3":
            # Gemma stores runs of spaces with real spaces; the normalizer below turns spaces into ▁,
            # and its merge order is the order of the vocabulary, not its scores (as transformers).
            tokens = ["▁" * len(t) if t and " " in t and not t.strip() else t for t in tokens]
            scores = {t: -i for i, t in enumerate(tokens)}
        else:
            scores = dict(zip(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)))
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges] if merges else _merges_from_vocab(vocab, scores)
        tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True,
                                  unk_token=tok_at("unknown_token_id") if arch == "gemma3" else None))
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if arch == "gemma3":
            tk.normalizer = normalizers.Replace(" ", "▁")
        else:
            prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
            tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix
                                                        else "never", split=False)
            steps += [decoders.Strip(content=" ", left=1)] if prefix else []
        tk.decoder = decoders.Sequence(steps)
        control_ok = lambda t: True  # noqa: E731
    else:
        raise CompileError(f"GGUF tokenizer '{kind}' is not supported (supported: gpt2, llama)")

    # Control tokens (type 3) are special; user-defined ones (type 4: <think>, Gemma's runs of
    # newlines...) are plain added tokens. Both must match whole, as llama.cpp matches them.
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True)
                           for t, ty in zip(tokens, types) if ty == 3 and control_ok(t)])
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
            if ty == 4 and t in tk.get_vocab()]
    if user:
        tk.add_tokens(user)

    # transformers defaults add_bos to true for SentencePiece files that do not say (llama.cpp does too)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = tok_at("bos_token_id"), tok_at("eos_token_id")
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    specials = [(t, tk.token_to_id(t)) for t in {bos, eos} if t and (t == bos and add_bos or t == eos and add_eos)]
    tk.post_processor = processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                                      special_tokens=specials)

    eos_ids = [i for i in (meta.get(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id",
                                                                          "eom_token_id")) if i is not None]
    eos_ids += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3 and t in _EOG_STRINGS]
    template = meta.get("tokenizer.chat_template")
    return {"json": tk.to_str(), "add_bos": add_bos, "eos_ids": list(dict.fromkeys(eos_ids)),
            "chat_template": template, "bos_id": meta.get("tokenizer.ggml.bos_token_id"),
            "special": {"bos_token": bos, "eos_token": eos, "pad_token": tok_at("padding_token_id"),
                        "unk_token": tok_at("unknown_token_id")}}


def _merges_from_vocab(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a piece into two pieces, best
    piece score first (transformers' generate_merges, same order, so ties break the same way)."""
    found = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        found.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    found.sort(key=lambda x: (x[2], len(x[0]), len(x[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _generation_config(meta: _Metadata, tok: dict) -> dict:
    """Sampling defaults some GGUFs carry (general.sampling.*), plus the ids HF's file would hold."""
    gen = {"bos_token_id": tok["bos_id"], "eos_token_id": tok["eos_ids"]}
    for key, hf in (("temp", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"), ("min_p", "min_p"),
                    ("penalty_repeat", "repetition_penalty")):
        if (v := meta.get(f"general.sampling.{key}")) is not None:
            gen[hf] = v
    return {k: v for k, v in gen.items() if v is not None and v != []}
