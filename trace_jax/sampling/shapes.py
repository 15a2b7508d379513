"""The shapes the sampler compiles for: power-of-two batches and cache lengths, `bucket_size`s, shared prefixes
padded to a multiple of 64, and how fed rows are grouped into row prefills (`ShapePolicy`)."""

from __future__ import annotations

from collections.abc import Sequence


def power_of_two(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def bucket_size(n: int, minimum: int) -> int:
    """The smallest size of the form 2^k or 3 * 2^(k-1) that is >= max(n, minimum).

    Steps of at most 1.5x keep padding (attention reads the whole cache) low while the
    number of distinct shapes, and so of compiled programs, grows only logarithmically.
    """
    n = max(int(n), minimum, 1)
    power = power_of_two(n)
    return power * 3 // 4 if power >= 4 and power * 3 // 4 >= n else power


PREFIX_MULTIPLE = 64

MIN_PIECE = 32  # a row prefill computes a power of two positions from this to the chunk


def prefix_capacity(n: int) -> int:
    """The padded length of a shared prefix of n tokens: the next multiple of `PREFIX_MULTIPLE`.

    A shared prefix (a system prompt) keeps its length for a whole job, so a fine step adds
    few compiled shapes, while every row attends over all of its padding, which a `bucket_size`
    would make up to half the prefix (1062 -> 1536 tokens for the tool-call task's prompt).
    """
    return -(-max(int(n), 1) // PREFIX_MULTIPLE) * PREFIX_MULTIPLE


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix all sequences share (0 for none)."""
    if not sequences:
        return 0
    first, length = sequences[0], min(len(s) for s in sequences)
    for seq in sequences[1:]:
        length = next((i for i in range(length) if seq[i] != first[i]), length)
    return length


def shared_prefix_length(prompts: Sequence[Sequence[int]], min_length: int | None) -> int:
    """How many leading prompt tokens may be run once for all rows (0: do not share).

    Sharing needs >= 2 prompts and at least `min_length` (None: never) common tokens; each
    row keeps at least its last prompt token, whose position predicts the first new token.
    """
    if min_length is None or len(prompts) < 2:
        return 0
    length = min(common_prefix_length(prompts), min(len(p) for p in prompts) - 1)
    return length if length >= max(min_length, 1) else 0


class ShapePolicy:
    """The shapes a sampler's programs take: rows rounded to powers of two (and to the mesh's batch multiple),
    cache lengths to powers of two, and row prefills grouped into few widths, so that a run compiles a bounded
    set of programs whatever its rows and lengths."""

    def __init__(self, batch_multiple: int, min_cache: int, max_context: int):
        self.batch_multiple, self.min_cache, self.max_context = batch_multiple, min_cache, max_context
        self._groups: dict[tuple[int, int], list[int]] = {}  # (rows, batch) -> `row_groups`

    def batch_size(self, rows: int) -> int:
        """`rows` rounded up to a power of two and to a multiple of the mesh's batch multiple."""
        return -(-power_of_two(rows) // self.batch_multiple) * self.batch_multiple

    def capacity(self, needed: int) -> int:
        """The cache length for `needed` positions: a power of two, at most the context limit.

        Every cache length compiles its own decode and row moves (row prefills: every window, the
        same powers of two up to the cache length), each program with hundreds of kernels, and
        XLA:CPU maps each kernel's code into memory apart, so a long job's programs can reach the
        kernel's limit on memory maps (docs/design.md, "Runtime settings"). Powers of two bound the
        programs of any run, for attention over at most twice the positions in use."""
        return min(max(power_of_two(needed), self.min_cache), self.max_context)

    def capacities(self) -> list[int]:
        """Every cache length `capacity` gives, smallest first."""
        lengths = [self.capacity(self.min_cache)]
        while lengths[-1] < self.max_context:
            lengths.append(self.capacity(2 * lengths[-1]))
        return lengths

    def rows_width(self, rows: int, batch: int) -> int:
        """How many rows a row prefill computes for `rows` fed rows of a `batch`-row cache: a power of
        four (1, 4, 16, ...) or the batch, whichever is less (few widths: few compiled programs)."""
        return min(self.batch_size(1 << (2 * -(-(max(rows, 1) - 1).bit_length() // 2))), batch)

    def row_groups(self, rows: int, batch: int) -> list[int]:
        """How many of `rows` fed rows each row-prefill call takes, largest first: the split computing the fewest
        rows (`rows_width` pads each call's), a call counting as half a row. Six rows are three calls of 4, 1
        and 1 rows rather than one of 16 (a server's requests arrive a few at a time)."""
        if (rows, batch) not in self._groups:
            best = [(0.0, [])]  # best[m]: (cost, group sizes) for m rows
            for m in range(1, rows + 1):
                best.append(
                    min(
                        (
                            (best[m - k][0] + self.rows_width(k, batch) + 0.5, [k, *best[m - k][1]])
                            for k in range(m, 0, -1)
                        ),
                        key=lambda option: option[0],
                    )
                )
            self._groups[rows, batch] = sorted(best[rows][1], reverse=True)
        return self._groups[rows, batch]
