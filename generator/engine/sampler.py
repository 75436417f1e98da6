"""Nucleus sampling without a full sort of the vocabulary (`NucleusSampler`)."""

from __future__ import annotations

from generator.engine.settings import SamplingSettings


class NucleusSampler:
    """Draws one token per row from exactly the distribution of transformers' sampling (`TemperatureLogitsWarper`,
    `TopKLogitsWarper`, `TopPLogitsWarper`, then multinomial) without sorting the vocabulary. The nucleus (the tokens
    whose higher-ranked tokens hold less than `top_p` of the probability) is looked for among the tokens of
    probability >= `floors[0]`: when those hold >= `top_p`, every nucleus token is among them, and only they are
    sorted. Rows whose candidates hold less try `floors[1]`, and so on; only the rows still short get a full sort. The
    draw is the inverse of the nucleus' cumulative distribution at one uniform number per row. Flat rows (no token as
    likely as `FLAT` / V) skip the floors, which would find most of the vocabulary: `_draw_flat` cuts them by value.

    Why: on SmolLM2's 49k-token vocabulary at top_p 0.95 the nucleus held 1-6,910 tokens (median 89; 35% of row-steps
    over 256), so `topk` over candidate counts that cover it (256, then 4,096) took 25 ms a call (median, 95-128 rows)
    on 2 CPU cores, a full sort ~1 ms a row; these floors take 12 ms on the same logits (`bench/bench_sampler.py`,
    docs/benchmarks.md). Draws use the global torch RNG (seeded by the caller)."""

    BLOCK = 64  # vocabulary entries a block: candidates are looked for in the blocks whose maximum clears the floor
    FLAT = 8  # a row whose likeliest token has p < FLAT / V holds >= top_p * V / FLAT tokens in its nucleus:
    # drawn by `_draw_flat` (random weights, a high temperature; never seen for SmolLM2 at T <= 1)

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 floors: tuple[float, ...] = (3e-5, 1e-5, 1e-6)):
        if temperature <= 0 or not 0 < top_p <= 1 or top_k < 0 or any(not 0 < f < 1 for f in floors):
            raise ValueError(f"need temperature > 0, 0 < top_p <= 1, top_k >= 0, 0 < floors < 1; got "
                             f"{temperature}, {top_p}, {top_k}, {floors}")
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.floors = tuple(sorted(floors, reverse=True))

    @classmethod
    def from_settings(cls, s: SamplingSettings) -> "NucleusSampler | None":
        return None if s.temperature == 0 else cls(s.temperature, s.top_p, s.top_k)

    def __call__(self, scores):
        """scores (B, V) -> sampled token ids (B,)."""
        import math

        import torch

        x = scores.float()  # (B, V)
        if self.temperature != 1:
            x = x / self.temperature
        B, V = x.shape
        if self.top_p >= 1 and not self.top_k:  # the whole vocabulary: no nucleus to find
            return self._draw_whole(x)
        if self.top_k:  # top-p within the top-k distribution (transformers' order of warpers)
            vals, idx = x.topk(min(self.top_k, V), dim=-1)  # (B, k), descending
            return idx.gather(-1, self._draw_sorted(vals - vals.logsumexp(-1, keepdim=True))).squeeze(-1)
        norm = x.logsumexp(-1)  # (B,)
        out = torch.empty(B, dtype=torch.long, device=x.device)
        rows = torch.arange(B, device=x.device)
        flat = x.amax(-1) - norm < math.log(self.FLAT / V)  # (B,) no token as likely as FLAT / V
        if bool(flat.any()):
            out[flat] = self._draw_flat(x[flat], norm[flat])
            rows = rows[~flat]
            if not len(rows):
                return out
        for floor in self.floors:
            sub = x if len(rows) == B else x[rows]  # no (B, V) copy on the first pass
            fits, tok = self._draw_among_candidates(sub, norm[rows], floor)
            out[rows[fits]] = tok[fits]
            rows = rows[~fits]
            if not len(rows):
                return out
        vals, idx = x[rows].sort(dim=-1, descending=True)  # the rows whose nucleus is wider than every floor
        out[rows] = idx.gather(-1, self._draw_sorted(vals - norm[rows, None])).squeeze(-1)
        return out

    @staticmethod
    def _draw_whole(x):
        """x (B, V) scores -> (B,) tokens drawn from softmax(x): the inverse of the cumulative distribution at one
        uniform number a row. Why not Gumbel-max: its exponential number per entry cost 7.5 ms a call at 8 x 49k
        (torch's CPU generator), this 0.7 ms; a decoding step of SmolLM2 at 8 rows takes ~50 ms."""
        import torch

        cum = (x - x.amax(-1, keepdim=True)).exp().double().cumsum(-1)  # (B, V); a -inf score adds nothing
        u = (1 - torch.rand_like(cum[:, :1])) * cum[:, -1:]  # (B, 1) in (0, mass]: never a zero-probability token
        return torch.searchsorted(cum, u).clamp(max=x.shape[-1] - 1).squeeze(-1)

    def _draw_flat(self, x, norm):
        """x (b, V) scores of rows whose nucleus is a large share of the vocabulary, norm (b,) -> (b,) tokens. The
        nucleus is cut by value, found from the bottom: the tokens outside it are the smallest k - 1, where the k
        smallest are the first to hold more than 1 - top_p of the mass (k among the smallest m, all V for a row
        whose m smallest hold less); in are the tokens scoring above the k-th smallest and as many tied with it as
        make the nucleus' size. The draw is the inverse of its cumulative distribution in vocabulary order, the
        same distribution as in rank order. Why: the floors would each find most of the vocabulary and sort it with
        the rows (148 ms for 24 such rows of SmolLM2's vocabulary, one thread), a full sort with indices took
        88 ms, numpy's sort of the values 24 ms, its partition of the smallest m and their sort 9 ms."""
        import math

        import torch

        b, V = x.shape
        m = min(V, max(1024, math.ceil(2 * (1 - self.top_p) * V)))  # a flat row's tail: about (1 - top_p) V tokens
        n, cut = self._flat_cut(x, norm, m)  # (b, 1) each
        wide = (n == 0).squeeze(-1)  # the m smallest held too little: every score
        if bool(wide.any()):
            n[wide], cut[wide] = self._flat_cut(x[wide], norm[wide], V)
        above = x > cut  # (b, V)
        tied = x == cut  # of these, the first n - |above| in vocabulary order are in (a sort's order is arbitrary)
        keep = above | (tied & (tied.cumsum(-1) <= n - above.sum(-1, keepdim=True)))
        q = torch.where(keep, (x - norm[:, None]).exp(), 0).double().cumsum(-1)  # (b, V), vocabulary order
        u = torch.rand_like(q[:, :1]) * q[:, -1:]  # (b, 1), uniform over the nucleus mass
        return torch.searchsorted(q, u).clamp(max=V - 1).squeeze(-1)

    def _flat_cut(self, x, norm, m: int):
        """(nucleus size (b, 1), its lowest score (b, 1)) from the m smallest scores of x (b, V); size 0 where
        those hold no more than 1 - top_p of the mass. With S_k the mass of the k smallest and k* the first k with
        S_k > 1 - top_p, the ranks j (from the top) whose higher-ranked tokens hold < top_p are j <= V - k* + 1."""
        import torch

        V = x.shape[-1]
        if x.device.type == "cpu":
            import numpy as np

            a = x.numpy()
            low = torch.from_numpy(np.sort(np.partition(a, m - 1, axis=-1)[:, :m] if m < V else a, axis=-1))
        else:
            low = x.topk(m, dim=-1, largest=False, sorted=True).values  # (b, m), ascending
        tail = (low - norm[:, None]).exp().double().cumsum(-1)  # (b, m)
        k = torch.searchsorted(tail, torch.full_like(tail[:, :1], 1 - self.top_p), right=True)  # (b, 1): k* - 1
        found = k < m
        cut = low.gather(-1, k.clamp(max=m - 1))
        return torch.where(found, V - k, 0), cut

    def _draw_sorted(self, logp):
        """logp (b, k) of tokens sorted by descending probability -> (b, 1) positions drawn from its nucleus."""
        import torch

        p = logp.double().exp()  # (b, k)
        cum = p.cumsum(-1)
        n = ((cum - p) < self.top_p).sum(-1, keepdim=True).clamp(min=1) if self.top_p < 1 else \
            torch.full_like(cum[:, :1], p.shape[-1], dtype=torch.long)  # (b, 1) nucleus size
        u = torch.rand_like(cum[:, :1]) * cum.gather(-1, n - 1)  # (b, 1), uniform over the nucleus mass
        return torch.searchsorted(cum, u).clamp(max=n - 1)

    def _candidates(self, x, lo):
        """(rows, columns) of the entries of x (b, V) >= lo (b,), row-major: a compare over the block maxima first,
        then over the blocks that clear it (a third of SmolLM2's at the first floor), not over every entry."""
        b, V = x.shape
        if V % self.BLOCK:
            return (x >= lo[:, None]).nonzero(as_tuple=True)
        blocks = x.view(b, V // self.BLOCK, self.BLOCK)
        rb, cb = (blocks.amax(-1) >= lo[:, None]).nonzero(as_tuple=True)  # (m,) blocks that hold a candidate
        i, j = (blocks[rb, cb] >= lo[rb, None]).nonzero(as_tuple=True)  # (n,) candidates in those blocks
        return rb[i], cb[i] * self.BLOCK + j

    def _draw_among_candidates(self, x, norm, floor: float):
        """x (b, V) scores, norm (b,) their logsumexp -> (fits (b,), tokens (b,)): a row fits when its tokens of
        probability >= floor hold >= top_p (then its token is drawn from the nucleus among them); others' tokens
        are meaningless."""
        import math

        import torch

        b = x.shape[0]
        r, c = self._candidates(x, norm + math.log(floor))  # (n,) each
        lp = x[r, c] - norm[r]  # (n,) log-probabilities, <= 0
        # candidates ordered by row, then by descending probability, in one sort: the row in the high 32 bits, the
        # bits of -logp (a non-negative float32's bits order as its value) in the low ones
        key = (r << 32) | (-lp).abs().view(torch.int32).long()
        order = key.argsort()
        r, c, p = r[order], c[order], lp[order].double().exp()
        cum = p.cumsum(0)  # (n,) over every row's candidates in turn
        count = torch.bincount(r, minlength=b)  # (b,)
        start = (count.cumsum(0) - count).clamp(max=max(len(p) - 1, 0))
        # no candidate in any row (flat rows: random weights, a high temperature): zeros on x's device, which
        # `before[r]` below indexes with r (on the CPU any device passes; on a GPU a CPU `before` failed, on an H200)
        before = torch.where(count > 0, cum[start] - p[start], 0) if len(p) else \
            torch.zeros(b, dtype=p.dtype, device=x.device)
        keep = (cum - p - before[r]) < self.top_p  # the mass ranked above each candidate, in its row
        mass = torch.zeros(b, dtype=p.dtype, device=x.device).index_add_(0, r, p)
        fits = (count > 0) & (mass >= self.top_p)
        n = torch.zeros(b, dtype=torch.long, device=x.device).index_add_(0, r, keep.long()).clamp(min=1)
        kept = torch.zeros_like(mass).index_add_(0, r, p * keep)
        u = torch.rand_like(mass) * kept  # (b,), uniform over each row's nucleus mass
        at = torch.searchsorted(cum, before + u)
        at = torch.minimum(torch.maximum(at, start), start + n - 1).clamp(max=max(len(c) - 1, 0))
        return fits, (c[at] if len(c) else torch.zeros(b, dtype=torch.long, device=x.device))
