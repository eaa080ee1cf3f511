"""Per-channel moments (count, mean, M2): per batch in the activation's precision, merged in float64.

M2 is the sum of squared deviations from the mean. Two sets of moments merge with Chan et
al.'s pairwise update, which is count-weighted and includes the between-set term; it never
forms E[x^2] - E[x]^2, which cancels catastrophically when |mean| >> std (1e4 + N(0, 1) in
float32 has no correct digit left in that form). Batches, calls and ranks all merge the same
way, so the order of merging changes the result only at float64 round-off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: batches whose moments wait to be folded in at once (one vectorised merge instead of one per call)
PENDING = 64
#: planes (the spatial extent of one sample's channel) at least this large are squared and summed by a
#: batched dot product, which reads them once; smaller ones by an in-place square and a sum (on this
#: project's CPUs the batched dot of many small planes costs more than the extra pass)
PLANE_DOT = 1024


def batch_sums(x: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(n, shift, sum(d), sum(d^2)) per channel of a (N, C, ...) or (N, C) input, d = x - shift, shift
    its mean: the sums of the corrected two-pass algorithm (``finish_sums`` turns them into mean and
    M2), in the activation's own dtype (float32 for half types), so that they cost about two reads of
    the input and one write of d instead of a float64 copy and five passes over it. d is centred, so
    nothing cancels whatever the offset: the mean comes out within a few roundings of the spread (not
    of |mean|), M2 within a few roundings of itself; float64 inputs stay exact to float64 round-off.
    Few operations on purpose: this runs for every BN call of a recalibration pass."""
    if x.dim() < 2:
        raise ValueError(f"a batch norm input has at least 2 dimensions (N, C, ...), not shape {tuple(x.shape)}")
    batch, channels = x.shape[0], x.shape[1]
    count = x.numel() // channels if channels else 0
    if count == 0:
        zeros = torch.zeros(channels, dtype=torch.float64, device=x.device)
        return 0, zeros, zeros.clone(), zeros.clone()
    if x.requires_grad:
        x = x.detach()
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    dims = [0, *range(2, x.dim())]
    shift = x.mean(dims)
    centred = x - shift.view([1, channels] + [1] * (x.dim() - 2))
    total = centred.sum(dims)
    plane = count // batch
    if plane >= PLANE_DOT and centred.is_contiguous():
        rows = centred.view(-1, 1, plane)  # one dot product per (sample, channel) plane, reading d once
        squares = torch.bmm(rows, rows.transpose(1, 2)).view(batch, channels).sum(0)
    else:
        squares = centred.mul_(centred).sum(dims)
    return count, shift, total, squares


def finish_sums(
    count, shift: torch.Tensor, total: torch.Tensor, squares: torch.Tensor, scale=1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, M2) in float64 from ``batch_sums``: mean = shift + sum(d)/n, M2 = scale * sum(d^2) - sum(d)^2/n.
    ``count`` and ``scale`` may be (K, 1) tensors for K stacked batches."""
    shift, total, squares = (t.to(torch.float64) for t in (shift, total, squares))
    mean = shift + total / count
    m2 = (squares * scale).sub_(total.square() / count).clamp_(min=0)
    return mean, m2


def batch_moments(x: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(elements per channel, mean, M2) of a (N, C, ...) or (N, C) input, in float64 (``batch_sums``)."""
    count, shift, total, squares = batch_sums(x)
    if count == 0:
        return 0, shift, squares
    return (count, *finish_sums(count, shift, total, squares))


def merge_moments(
    count_a: float, mean_a: torch.Tensor, m2_a: torch.Tensor, count_b: float, mean_b: torch.Tensor, m2_b: torch.Tensor
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Chan et al.: the moments of the union of two sets, weighted by their counts."""
    if count_b == 0:
        return count_a, mean_a, m2_a
    if count_a == 0:
        return count_b, mean_b.clone(), m2_b.clone()
    total = count_a + count_b
    delta = mean_b - mean_a
    mean = mean_a + delta * (count_b / total)
    m2 = m2_a + m2_b + delta.square() * (count_a * count_b / total)
    return total, mean, m2


def fold_moments(counts: list[int], means: torch.Tensor, m2s: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The moments of the union of K sets at once, from their (K,) counts and (K, C) means and M2s:
    n = sum n_k, mean = sum n_k mean_k / n, M2 = sum M2_k + sum n_k (mean_k - mean)^2. The same
    terms as Chan's pairwise update (the between-set term from the deviations of the set means
    from the union's mean, never from raw second moments), in one vectorised step."""
    total = sum(counts)
    if total == 0:
        return 0, torch.zeros_like(means[0]), torch.zeros_like(m2s[0])
    weights = torch.tensor(counts, dtype=torch.float64, device=means.device)
    mean = (weights[:, None] * means).sum(0) / total
    deviation = means - mean
    m2 = m2s.sum(0) + (weights[:, None] * deviation.square()).sum(0)
    return total, mean, m2


@dataclass
class Moments:
    """Running float64 moments of one module's input, per channel. ``add`` keeps each batch's moments
    and folds them in every ``PENDING`` batches (``settle``); every read settles first."""

    count: int
    mean: torch.Tensor
    m2: torch.Tensor
    pending: list = field(default_factory=list, repr=False)

    @classmethod
    def empty(cls, channels: int, device: "torch.device | str" = "cpu") -> "Moments":
        return cls(
            0,
            torch.zeros(channels, dtype=torch.float64, device=device),
            torch.zeros(channels, dtype=torch.float64, device=device),
        )

    def add(self, x: torch.Tensor) -> None:
        self.push_sums(*batch_sums(x))

    def push(self, count: int, mean: torch.Tensor, m2: torch.Tensor) -> None:
        """One batch's float64 moments (``batch_moments``), folded in with the next ``settle``."""
        self.push_sums(count, mean, torch.zeros_like(mean), m2)

    def push_sums(
        self, count: int, shift: torch.Tensor, total: torch.Tensor, squares: torch.Tensor, scale: float = 1.0
    ) -> None:
        """One batch's ``batch_sums`` (M2 = scale * squares - total^2 / n), kept as they are: turned into
        float64 moments and folded in with the next ``settle``, all waiting batches in one step."""
        if count:
            self.pending.append((count, scale, shift, total, squares))
        if len(self.pending) >= PENDING:
            self.settle()

    def settle(self) -> None:
        """Fold the waiting batches in (with the moments so far as one more set)."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        counts = [entry[0] for entry in pending]
        columns = [
            torch.tensor([entry[i] for entry in pending], dtype=torch.float64, device=self.mean.device)[:, None]
            for i in (0, 1)
        ]
        stacked = [_stack([entry[i] for entry in pending]) for i in (2, 3, 4)]
        means, m2s = finish_sums(columns[0], stacked[0], stacked[1], stacked[2], scale=columns[1])
        if self.count:
            counts = [self.count] + counts
            means, m2s = torch.cat([self.mean[None], means]), torch.cat([self.m2[None], m2s])
        total, mean, m2 = fold_moments(counts, means, m2s)
        self.count, self.mean, self.m2 = int(total), mean, m2

    def merge(self, count: int, mean: torch.Tensor, m2: torch.Tensor) -> None:
        self.settle()
        total, self.mean, self.m2 = merge_moments(
            self.count, self.mean, self.m2, count, mean.to(self.mean.device), m2.to(self.m2.device)
        )
        self.count = int(total)

    @property
    def population_var(self) -> torch.Tensor:
        """The biased (population) variance: M2 / n."""
        self.settle()
        return self.m2 / max(self.count, 1)

    @property
    def unbiased_var(self) -> torch.Tensor:
        """What torch stores in ``running_var``: M2 / (n - 1) (M2 / 1 = 0 for a single element)."""
        self.settle()
        return self.m2 / max(self.count - 1, 1)

    def row(self) -> torch.Tensor:
        """[n, mean..., M2...] as one float64 row (counts are exact in float64 up to 2**53)."""
        self.settle()
        head = torch.tensor([float(self.count)], dtype=torch.float64, device=self.mean.device)
        return torch.cat([head, self.mean, self.m2])


def settle_all(moments: "list[Moments]") -> None:
    """``settle`` every one of ``moments`` in one set of vectorised operations over every waiting batch of
    every one (each set's channels laid end to end): one settle costs some thirty small operations, which
    at the end of a short pass over a model with many thin BN layers costs more than the statistics."""
    waiting = [m for m in moments if m.pending]
    if len({m.mean.device for m in waiting}) > 1:
        for m in waiting:
            m.settle()
        return
    if not waiting:
        return
    entries: list[tuple] = []
    owners, offsets, start = [], [], 0
    for index, m in enumerate(waiting):
        offsets.append(start)
        if m.count:
            entries.append((m.count, 1.0, m.mean, torch.zeros_like(m.mean), m.m2))
            owners.append(index)
        entries += m.pending
        owners += [index] * len(m.pending)
        start += m.mean.numel()
    device = waiting[0].mean.device
    lengths = torch.tensor([entry[2].numel() for entry in entries], device=device)
    per_entry = torch.tensor(
        [[float(entry[0]), float(entry[1])] for entry in entries], dtype=torch.float64, device=device
    )
    counts, scales = per_entry.repeat_interleave(lengths, 0).unbind(1)
    # the global channel of every element: its owner's offset + its place within its entry
    firsts = torch.cumsum(lengths, 0) - lengths
    entry_of = torch.repeat_interleave(torch.arange(len(entries), device=device), lengths)
    channel = (
        torch.arange(int(lengths.sum()), device=device)
        - firsts[entry_of]
        + torch.tensor([offsets[o] for o in owners], device=device)[entry_of]
    )
    shift, total, squares = (torch.cat([entry[i] for entry in entries]).to(torch.float64) for i in (2, 3, 4))
    means, m2s = finish_sums(counts, shift, total, squares, scale=scales)
    zeros = torch.zeros(start, dtype=torch.float64, device=device)
    n = zeros.index_add(0, channel, counts)
    mean = zeros.index_add(0, channel, counts * means).div_(n.clamp(min=1))
    m2 = zeros.index_add(0, channel, m2s.add_(counts * (means - mean[channel]).square()))
    for index, m in enumerate(waiting):
        channels = slice(offsets[index], offsets[index] + m.mean.numel())
        m.count = m.count + sum(entry[0] for entry in m.pending)
        m.mean, m.m2, m.pending = mean[channels], m2[channels], []


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One (K, C) tensor in float64 (one cast for the stack, one per tensor only where dtypes differ)."""
    if len({t.dtype for t in tensors}) > 1:
        tensors = [t.to(torch.float64) for t in tensors]
    return torch.stack(tensors).to(torch.float64)


def merge_rows(rows: torch.Tensor, channels: int) -> Moments:
    """The moments of the union of the sets whose [n, mean, M2] rows are ``rows`` (W, 1 + 2C),
    merged in row order (the same order on every rank, so every rank gets the same bits)."""
    result = Moments.empty(channels, rows.device)
    for row in rows:
        count = int(row[0].item())
        result.merge(count, row[1 : 1 + channels], row[1 + channels : 1 + 2 * channels])
    return result
