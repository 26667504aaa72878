"""A tiny random-weight Llama with its own tokenizer, for `kvduplex demo`, tests and benchmarks.

Nothing can be downloaded where kvduplex is tested, yet every end-to-end path needs a model that
vLLM serves. This module writes one from scratch: a 4-layer Llama (float32 safetensors, ~12 MB)
and a byte-level BPE tokenizer trained on generated text. Both are fully determined by the
constants below, so two builds (on any machine with the same library versions) produce the same
weights and the same token ids.

Usage: ``build_tiny_model(Path(...))``. The other variants (a chat tokenizer whose ids
round-trip, hybrid and realistic shapes) and the command line ``python -m
kvduplex_testing.tiny_model`` live in `kvduplex_testing.tiny_model`, which is not installed.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

SEED = 20261202
VOCAB_SIZE = 1024
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"

MODEL_CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    # Wider than Llama's 0.02 on purpose: with 0.02 the next-token distribution is almost flat
    # (top-2 gap ~0.03 nats) and greedy decoding loops on one or two tokens. At 0.1 outputs vary
    # with the prompt and a changed early token moves late logprobs by ~1 nat, so a wrong KV
    # block shows up in test comparisons instead of hiding in a near-tie.
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "dtype": "float32",
}

# A plain turn-by-turn format; `/v1/chat/completions` needs some template to render messages.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

SERVED_MODEL_NAME = "kvduplex-tiny"
# Arguments every server of this model gets, so that outputs of different servers compare:
# float32 (vLLM's CPU default would run this float32 checkpoint in bfloat16, whose rounding
# blurs logprob comparisons), eager mode (no compile time), a fixed seed, one model name.
SERVER_ARGS = (
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-model-len",
    "2048",
    "--seed",
    "0",
    "--served-model-name",
    SERVED_MODEL_NAME,
)

# Written last; its presence (with matching contents) means the directory is complete.
COMPLETE_MARKER = "kvduplex_tiny_model.json"
_SPEC = {
    # Bump when the build changes in a way the fields below do not capture (training text,
    # tokenizer setup), so that cached builds are replaced.
    "format": 1,
    "seed": SEED,
    "model": MODEL_CONFIG,
    "chat_template": CHAT_TEMPLATE,
}

SYLLABLES = (
    "ka ri to mo na shi lu ve po de an el is or um ex ta ne ro sa mi qu ba "
    "zo fi gu he ja ki ly wu".split()
)
_PUNCTUATION = (".", ",", "?", "!", ";", ":")

def training_vocabulary(rng: random.Random) -> list[str]:
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(600)]
    return words + ["user", "assistant", "system", "nonce", "turn", "the", "a", "of", "and"]


def _sentence(rng: random.Random, vocabulary: list[str], num_words: int) -> str:
    words = []
    for _ in range(num_words):
        roll = rng.random()
        if roll < 0.08:
            words.append(str(rng.randint(0, 99999)))
        elif roll < 0.12:
            words.append(f"{rng.getrandbits(32):08x}")
        else:
            word = rng.choice(vocabulary)
            words.append(word.capitalize() if rng.random() < 0.1 else word)
    return " ".join(words) + rng.choice(_PUNCTUATION)


def _training_text(rng: random.Random, num_lines: int = 4000) -> list[str]:
    """Deterministic pseudo-language: words built from syllables, plus digits and punctuation.

    Enough variety that BPE learns ~1000 merges, and covering what tests put in prompts
    (hex nonces, numbers, chat role names).
    """
    vocabulary = training_vocabulary(rng)
    return [_sentence(rng, vocabulary, rng.randint(4, 16)) for _ in range(num_lines)]


def sample_text(num_words: int, seed: int = 0) -> str:
    """`num_words` words of the tokenizer's training language (about 2 tokens a word), by seed.

    For prompts of a chosen length: the same (num_words, seed) always gives the same text.
    """
    rng = random.Random(f"{SEED}-{seed}")
    vocabulary = training_vocabulary(random.Random(SEED))
    sentences = []
    while num_words > 0:
        length = min(num_words, rng.randint(4, 16))
        sentences.append(_sentence(rng, vocabulary, length))
        num_words -= length
    return " ".join(sentences)


def _build_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(random.Random(SEED)), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"tokenizer training produced {tokenizer.get_vocab_size()} tokens, "
            f"expected {VOCAB_SIZE}; the training text is too small"
        )
    save_tokenizer_with_bos(tokenizer, out_dir, CHAT_TEMPLATE)


def save_tokenizer_with_bos(tokenizer, out_dir: Path, chat_template: str, **extra: object) -> None:
    """Prepend BOS to every encoding and save as a transformers fast tokenizer with the template."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        **extra,
    )
    fast.chat_template = chat_template
    fast.save_pretrained(out_dir)


def _build_model(out_dir: Path, model_config: dict) -> None:
    import torch
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        GraniteMoeHybridConfig,
        GraniteMoeHybridForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
    )

    added_tokens = json.loads((out_dir / "tokenizer.json").read_text())["added_tokens"]
    ids = {token["content"]: token["id"] for token in added_tokens}
    model_config = dict(model_config)
    architecture = model_config.pop("architecture", "llama")
    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "gemma2": (Gemma2Config, Gemma2ForCausalLM),
        "granitemoehybrid": (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM),
    }[architecture]
    config = config_class(
        **model_config,
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
        pad_token_id=ids[PAD_TOKEN],
    )
    # Fork the global RNG so building a model inside a test run does not shift its random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = model_class(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)


def is_complete(model_dir: Path, spec: dict = _SPEC) -> bool:
    """True when `model_dir` holds a finished build of exactly this tiny model (or of the variant
    `spec` describes)."""
    marker = Path(model_dir) / COMPLETE_MARKER
    try:
        return json.loads(marker.read_text()) == spec
    except (OSError, ValueError):
        return False


def build_tiny_model(out_dir: Path) -> Path:
    """Write the tiny model and tokenizer to `out_dir` (created if needed) and return it.

    Reuses `out_dir` when it already holds a complete build of the same spec. The files are
    written into a sibling temporary directory and renamed into place, so an interrupted or
    concurrent build never leaves a half-written model behind.
    """
    return build_model(out_dir, _SPEC, _build_tokenizer)


def build_model(out_dir: Path, spec: dict, build_tokenizer: Callable[[Path], None]) -> Path:
    """Write the model `spec` describes (its "model" config) with the tokenizer `build_tokenizer`
    writes into a directory, to `out_dir`, and return it; see `build_tiny_model`."""
    out_dir = Path(out_dir).resolve()
    what = f"{spec.get('variant', 'tiny')} model"
    if is_complete(out_dir, spec):
        logger.debug("reusing %s at %s", what, out_dir)
        return out_dir
    if (out_dir / COMPLETE_MARKER).exists():
        logger.info("rebuilding %s at %s: it was built from a different spec", what, out_dir)
    elif out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(
            f"{out_dir} is not empty and holds no tiny model; refusing to replace it"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary directory
    try:
        build_tokenizer(staging)
        _build_model(staging, spec["model"])
        (staging / COMPLETE_MARKER).write_text(json.dumps(spec, indent=1, sort_keys=True))
        if is_complete(out_dir, spec):  # another process finished first
            return out_dir
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("built %s at %s", what, out_dir)
    return out_dir

