"""The end-to-end harness itself: the reference server is a usable source of expected outputs."""

import pytest

from kvduplex.servers import complete, describe_mismatch, with_nonce
from kvduplex.tiny_model import sample_text

# ~300 tokens: the nonce sits in the first 128-token KV block, generation starts in the third.
PROMPT_WORDS = 150
MAX_TOKENS = 8


@pytest.mark.e2e
def test_reference_server_is_deterministic_and_history_sensitive(reference_server):
    prompt = with_nonce(sample_text(PROMPT_WORDS))
    first = complete(reference_server.base_url, prompt, MAX_TOKENS)
    # The repeat is served partly from the prefix cache: cached KV must give the same answer.
    second = complete(reference_server.base_url, prompt, MAX_TOKENS)

    assert len(first.prompt_token_ids) > 2 * 128
    assert len(first.token_ids) == len(first.logprobs) == MAX_TOKENS
    assert all(len(alternatives) >= 5 for alternatives in first.top_logprobs)
    assert describe_mismatch(first, second, logprob_atol=1e-5) is None

    # Only the nonce differs, two blocks before generation starts: if that changed nothing,
    # comparing outputs could not reveal KV blocks that were lost or taken from another prompt.
    other_prompt = with_nonce(sample_text(PROMPT_WORDS))
    other_history = complete(reference_server.base_url, other_prompt, MAX_TOKENS)
    differences = [abs(a - b) for a, b in zip(first.logprobs, other_history.logprobs, strict=True)]
    assert max(differences) > 1e-2, differences
