"""The demo's text and its batches (`rtp_compile.apps.corpus`) and sampling (`models.generate`):
in-process, no ranks."""

import pytest
import torch

from rtp_compile.apps.corpus import (
    ALPHABET,
    VOCAB_SIZE,
    TextBatches,
    decode,
    encode,
    load_text,
    split,
    windows,
)
from rtp_compile.apps.models import GPTConfig, TinyGPT, generate


def test_the_shipped_text_round_trips_through_tokens_of_tinygpts_vocabulary():
    text = load_text()
    assert 250_000 < len(text) < 400_000 and text.startswith("First Citizen:")
    tokens = encode(text)
    assert VOCAB_SIZE == GPTConfig().vocab_size == 96
    assert 0 <= int(tokens.min()) and int(tokens.max()) < VOCAB_SIZE
    assert decode(tokens) == text


def test_encode_names_a_character_outside_the_alphabet():
    with pytest.raises(ValueError, match="'é'"):
        encode("café")


def test_split_holds_out_the_last_tenth_and_windows_cover_it():
    tokens = torch.arange(1001) % VOCAB_SIZE
    train, held = split(tokens)
    assert torch.equal(torch.cat([train, held]), tokens) and len(held) == 100
    inputs, targets = windows(held, 8)
    assert inputs.shape == targets.shape == (12, 8)
    assert torch.equal(inputs.flatten()[1:], targets.flatten()[:-1])


def _steps(batches, n):
    return [batches.next_batch() for _ in range(n)]


def test_ranks_take_disjoint_windows_and_targets_are_the_next_tokens():
    tokens = torch.arange(500)  # token i at position i: a window's start is its first token
    world = [TextBatches(tokens, 16, 4, rank, 3, seed=7) for rank in range(3)]
    for _ in range(5):
        batches = [b.next_batch() for b in world]
        starts = [int(s) for inputs, _ in batches for s in inputs[:, 0]]
        assert len(set(starts)) == 12  # no window twice within a step
        for inputs, targets in batches:
            assert torch.equal(targets, inputs + 1)


def test_a_restored_position_resumes_the_same_stream_across_epochs():
    tokens = torch.arange(40)  # 30 windows: an epoch every 5 steps of 2 ranks x 3
    first = TextBatches(tokens, 10, 3, 1, 2, seed=3)
    _steps(first, 4)
    state = first.state_dict()
    expected = _steps(first, 8)
    resumed = TextBatches(tokens, 10, 3, 1, 2, seed=3)
    resumed.load_state_dict(state)
    for (x, y), (ex, ey) in zip(_steps(resumed, 8), expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    again = _steps(TextBatches(tokens, 10, 3, 1, 2, seed=3), 2)
    other = _steps(TextBatches(tokens, 10, 3, 1, 2, seed=4), 2)
    assert not all(torch.equal(x, ox) for (x, _), (ox, _) in zip(again, other))


@pytest.fixture
def one_thread():
    """Tiny forwards on one thread: two threads on 2 shared cores wait ~0.3 s a forward."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_generate_is_reproducible_by_seed_and_greedy_at_temperature_zero(one_thread):
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(block_size=8))
    prompt = encode("ROMEO:\n")
    out = generate(model, prompt, 20, seed=1)
    assert out.shape == (27,) and torch.equal(out[:7], prompt)
    assert torch.equal(out, generate(model, prompt, 20, seed=1))
    assert all(ch in ALPHABET for ch in decode(out))
    greedy = generate(model, prompt, 3, temperature=0)
    with torch.no_grad():
        assert int(greedy[7]) == int(model(prompt[-8:].unsqueeze(0))[0, -1].argmax())
    assert model.training  # left as it was found
