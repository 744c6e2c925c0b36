"""The demo's text: a Shakespeare excerpt shipped in the package, its character tokens, batches.

`load_text()` reads `rtp_compile/apps/data/tinyshakespeare.txt` (public domain; source and cut in
`rtp_compile/apps/data/README.md`). Tokens are characters of a fixed 96-symbol alphabet, newline and
the 95 printable ASCII characters, so TinyGPT's default vocabulary of 96 fits any ASCII text.
`split` keeps the text's last tenth apart for a held-out loss. `TextBatches` hands one rank its
batches of random windows, the ranks' batches disjoint within a step, in an order fixed by the
seed; its one number of state, the position in that order, is what a checkpoint keeps to resume
the same stream of batches.
"""

from __future__ import annotations

from importlib import resources

import torch

ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))  # token i is ALPHABET[i]
VOCAB_SIZE = len(ALPHABET)  # 96
TEXT_FILE = "tinyshakespeare.txt"
_INDEX = {ch: i for i, ch in enumerate(ALPHABET)}
_TABLE = torch.full((128,), -1, dtype=torch.long)  # ASCII code -> token id, -1: not a token
_TABLE[[ord(ch) for ch in ALPHABET]] = torch.arange(len(ALPHABET))


def load_text(name: str = TEXT_FILE) -> str:
    """The text of a file in `rtp_compile/apps/data/` (read from the installed package)."""
    return resources.files("rtp_compile.apps").joinpath("data", name).read_text(encoding="ascii")


def encode(text: str) -> torch.Tensor:
    """Token ids of `text`, int64 [len(text)]; ValueError naming a character outside ALPHABET."""
    bad = None
    if text.isascii():
        ids = _TABLE[torch.tensor(list(text.encode("ascii")), dtype=torch.long)]
        if bool((ids < 0).any()):
            bad = text[int((ids < 0).nonzero()[0])]
    else:
        bad = next(ch for ch in text if not ch.isascii())
    if bad is not None:
        raise ValueError(
            f"encode: character {bad!r} is not in the alphabet (newline and "
            "printable ASCII); replace it first"
        )
    return ids


def decode(ids) -> str:
    """The text of token ids (a tensor or a sequence of ints)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    return "".join(ALPHABET[i] for i in ids)


def split(tokens: torch.Tensor, held_out: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(training tokens, held-out tokens): the last `held_out` fraction of the text is held out."""
    cut = round(len(tokens) * (1 - held_out))
    return tokens[:cut], tokens[cut:]


def windows(tokens: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All non-overlapping windows of `tokens` as (inputs, targets), each [n, block_size]:
    the held-out set, evaluated whole."""
    n = (len(tokens) - 1) // block_size
    inputs = tokens[: n * block_size].view(n, block_size)
    targets = tokens[1 : n * block_size + 1].view(n, block_size)
    return inputs, targets


class TextBatches:
    """One rank's batches of `batch_size` windows of `block_size` + 1 tokens from `tokens`.

    Every window start is visited once an epoch, in an order shuffled per epoch by `seed`.
    A step takes the next `world_size * batch_size` windows of that order, rank r the r-th
    `batch_size` of them, so the ranks of one step never share a window. `position` counts the
    windows all ranks have taken: `state_dict()` / `load_state_dict()` save and restore it (at
    any world size, the stream goes on from the same place).
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        block_size: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"TextBatches: rank must be in [0, {world_size}), got {rank}")
        self.n_windows = len(tokens) - block_size
        if self.n_windows < 1:
            raise ValueError(
                f"TextBatches: {len(tokens)} tokens hold no window of {block_size} + 1"
            )
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.position = 0
        self._epoch, self._order = None, None

    def _start(self, index: int) -> int:
        """The first token of window number `index` of the stream."""
        epoch, i = divmod(index, self.n_windows)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.n_windows, generator=gen)
        return int(self._order[i])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next (inputs, targets), each [batch_size, block_size]; targets are the
        inputs shifted by one token. Advances `position` by one step of all ranks."""
        first = self.position + self.rank * self.batch_size
        starts = [self._start(first + j) for j in range(self.batch_size)]
        seq = torch.stack([self.tokens[s : s + self.block_size + 1] for s in starts])
        self.position += self.world_size * self.batch_size
        return seq[:, :-1], seq[:, 1:]

    def state_dict(self) -> dict:
        """What a checkpoint keeps to resume this stream of batches."""
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Resume from a `state_dict()`."""
        self.position = int(state["position"])
