"""Batched sampling from the last-token logits: bias, penalties, bans, greedy, temperature, top-k/p, min-p, seeds."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import cpu_sampling
from workers.layers.logprobs import raw_logprobs, rows_logprobs


@dataclass
class Penalties:
    """Rows that have any penalty, with what each penalty looks at; tensors on the logits' device."""

    rows: list[int]
    presence: torch.Tensor  # [len(rows)]; 0 → off
    frequency: torch.Tensor  # [len(rows)]; 0 → off
    repetition: torch.Tensor  # [len(rows)]; 1 → off
    output_token_ids: list[list[int]]  # presence and frequency count the generated tokens (OpenAI's rule)
    seen_token_ids: list[list[int]]  # repetition looks at prompt + generated tokens (transformers' rule)


@dataclass
class GrammarRows:
    """Rows whose tokens a grammar restricts: bit j of word w in packed[i] allows token 32 * w + j in rows[i]."""

    rows: list[int]
    packed: torch.Tensor  # [len(rows), words] int32, on the logits' device


@dataclass
class SamplingMetadata:
    """One row per request being sampled this step; its tensors are on the logits' device."""

    temperature: torch.Tensor  # [rows]; 0 → greedy
    top_k: torch.Tensor | None  # [rows]; 0 → off; None when no row uses it
    top_p: torch.Tensor | None  # [rows]; 1.0 → off
    min_p: torch.Tensor | None  # [rows]; 0.0 → off
    generators: dict[int, torch.Generator]  # row → its request's seeded generator
    banned_token_ids: dict[int, list[int]]  # row → tokens not allowed yet (EOS/stop ids under min_tokens)
    num_logprobs: dict[int, int]  # row → how many top logprobs the request asked for
    penalties: Penalties | None = None
    logit_bias: dict[int, dict[int, float]] | None = None  # row → token id → bias
    grammar: GrammarRows | None = None  # rows under a structured-output constraint, and their allowed tokens
    # [rows] int64: the draft token each row verifies, -1 for none (speculative decoding); None when no row does
    draft_token_ids: torch.Tensor | None = None
    # [rows, vocab]: the distribution each draft was drawn from (a draft model's); None: drafts are one-hot guesses
    draft_probs: torch.Tensor | None = None
    # Whether every row is greedy, as the host knows it; None: read from temperature (which waits for the device).
    every_row_greedy: bool | None = None
    any_row_greedy: bool | None = None  # as the host knows it; None: unknown (the argmax is taken)

    @property
    def all_greedy(self) -> bool:
        if self.every_row_greedy is not None:
            return self.every_row_greedy
        return bool((self.temperature == 0).all())


@dataclass
class SamplerOutput:
    token_ids: list[int]  # per row: its draft where accepted, else the token sampled in its place
    # row → ([sampled, top-N ...] ids, their logprobs, rank of the sampled token)
    logprobs: dict[int, tuple[list[int], list[float], int]]
    accepted: list[bool] | None = None  # per row: whether its draft was accepted (None: no row had a draft)


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for rows without a seed of their own

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata,
                 before_sync: Callable[[torch.Tensor], torch.Tensor] | None = None) -> SamplerOutput:
        """logits: [rows, vocab] float32, changed in place. If sampling fails, the logits and every generator are
        left as they were, so the caller can sample the rows again (e.g. one by one, to find the bad one).
        before_sync: where no row verifies a draft, called with the sampled tokens (a device tensor, one per row)
        once everything else is queued; it returns the tokens to read (e.g. a host copy queued before work of its own
        that reading must not wait for)."""
        saved = _SavedInputs(logits, meta, self.generator)
        try:
            return self._sample(logits, meta, before_sync)
        except Exception:
            saved.restore(logits)
            raise

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata,
                before_sync: Callable[[torch.Tensor], torch.Tensor] | None) -> SamplerOutput:
        # Logprobs are those of the model's own distribution (vLLM's default): before bias, penalties,
        # bans and temperature, whatever the token was then sampled from.
        logprobs_of_rows = raw_logprobs(logits) if meta.num_logprobs else None
        _process(logits, meta)
        greedy_tokens = logits.argmax(dim=-1) if meta.any_row_greedy is not False else None
        if meta.all_greedy:
            tokens = greedy_tokens
            accepted = None if meta.draft_token_ids is None else greedy_tokens == meta.draft_token_ids
        else:
            tokens, accepted = self._random_sample(logits, meta, greedy_tokens)
        if accepted is not None:
            tokens = torch.where(accepted, meta.draft_token_ids, tokens)
        logprobs = rows_logprobs(logprobs_of_rows, tokens, meta.num_logprobs) if logprobs_of_rows is not None else {}
        if accepted is None and before_sync is not None:
            tokens = before_sync(tokens)
        return SamplerOutput(tokens.tolist(), logprobs, None if accepted is None else accepted.tolist())

    def draft(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft model's tokens, its logits processed as the target's will be; and the distribution each row drew
        from (None when every row is greedy), which the target's verification needs."""
        _process(logits, meta)
        greedy_tokens = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy_tokens, None
        if cpu_sampling.serves(logits):  # _distribution and _inverse_cdf in C++, as the C++ steps draw drafts
            temperature = torch.where(meta.temperature == 0, 1.0, meta.temperature)
            tokens, probs = cpu_sampling.draft(logits, temperature, self._uniform(meta, logits.shape[0]), meta.top_k,
                                               meta.top_p, meta.min_p)
            none = tokens < 0  # no distribution (a NaN): the argmax, as a one-hot guess
            tokens = torch.where(none, greedy_tokens, tokens)
            probs[none] = torch.nn.functional.one_hot(greedy_tokens[none], probs.shape[1]).float()
        else:
            probs = _distribution(logits, meta)
            tokens = self._inverse_cdf(probs, meta)
        return torch.where(meta.temperature == 0, greedy_tokens, tokens), probs

    def _random_sample(self, logits: torch.Tensor, meta: SamplingMetadata, greedy_tokens: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sampled tokens, and for draft rows whether the draft is accepted (greedy rows: if it is the argmax).
        greedy_tokens: each row's argmax; None where no row is greedy."""
        accepted = None
        drafts = meta.draft_token_ids
        if cpu_sampling.serves(logits):  # _distribution, _verify_drafts and _inverse_cdf in C++
            temperature = torch.where(meta.temperature == 0, 1.0, meta.temperature)
            accept = None if drafts is None else self._draw(torch.Tensor.uniform_, (logits.shape[0],), meta)
            sampled = cpu_sampling.sample(logits, temperature, self._uniform(meta, logits.shape[0]), meta.top_k,
                                          meta.top_p, meta.min_p, drafts, accept, meta.draft_probs)
            if drafts is not None:
                accepted = (drafts >= 0) & (sampled == drafts)
        else:
            probs = _distribution(logits, meta)
            if meta.draft_token_ids is not None:
                accepted, probs = self._verify_drafts(probs, meta)
            sampled = self._inverse_cdf(probs, meta)
        if greedy_tokens is None:
            return sampled, accepted
        greedy = meta.temperature == 0
        if accepted is not None:
            accepted = torch.where(greedy, greedy_tokens == meta.draft_token_ids, accepted)
        return torch.where(greedy, greedy_tokens, sampled), accepted

    def _inverse_cdf(self, weights: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """A token per row, drawn in proportion to its row of `weights` (>= 0, any positive sum), without a sync:
        the first token whose running sum exceeds one uniform draw times the row's sum. One random number per row;
        Gumbel-max's exponential per token cost 12.8 ms for 64 rows of 8,256 on a 2-core CPU, this 0.3 ms. The sums
        run in float64 so that a rare token's share is not lost to rounding over a large vocabulary."""
        cdf = weights.to(torch.float64).cumsum(dim=-1)
        total = cdf[:, -1:]
        draw = self._uniform(meta, weights.shape[0])
        # Strictly below the sum, so the token found has a weight above zero (u * sum can round up to the sum).
        point = torch.minimum(draw * total, torch.nextafter(total, torch.zeros_like(total)))
        # A row whose weights are all zero (a verified draft's residual where the draft is surely accepted) finds
        # none: its index is clamped, and the caller keeps the draft.
        return torch.searchsorted(cdf, point, right=True).squeeze(1).clamp_(max=weights.shape[1] - 1)

    def _uniform(self, meta: SamplingMetadata, rows: int) -> torch.Tensor:
        """The inverse CDF's draw for each row, [rows, 1] float64 (from float32: one number per row)."""
        return self._draw(torch.Tensor.uniform_, (rows, 1), meta).to(torch.float64)

    def _verify_drafts(self, probs: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative sampling: accept draft d, drawn from q, with probability min(1, p(d) / q(d)); a rejected row
        samples from max(0, p - q) (unnormalised: the inverse CDF does not need it). Without draft_probs q is one-hot:
        accept with probability p(d), else sample from p without d. Rows without a draft keep p (the token after
        the accepted ones)."""
        drafts = meta.draft_token_ids
        has_draft = drafts >= 0
        index = drafts.clamp(min=0).unsqueeze(1)
        uniform = self._draw(torch.Tensor.uniform_, (probs.shape[0],), meta)
        target = probs.gather(1, index).squeeze(1)
        if meta.draft_probs is None:
            accepted = uniform < target
            residual = probs.scatter(1, index, 0.0)
        else:
            accepted = uniform * meta.draft_probs.gather(1, index).squeeze(1) < target
            residual = (probs - meta.draft_probs).clamp(min=0.0)
        return has_draft & accepted, torch.where(has_draft.unsqueeze(1), residual, probs)

    def _draw(self, fill, shape: tuple[int, ...], meta: SamplingMetadata) -> torch.Tensor:
        """Random numbers per row from `fill` (a Tensor method), a seeded request's rows from its own generator."""
        values = fill(torch.empty(shape, device=meta.temperature.device), generator=self.generator)
        for row, generator in meta.generators.items():
            if generator.device == values.device:
                fill(values[row], generator=generator)
            else:  # a request's seeded generator is a CPU one: its numbers are drawn there, the same on any device
                values[row] = fill(torch.empty(shape[1:]), generator=generator)
        return values


class _SavedInputs:
    """What sampling changes in place: the rows that get a bias, penalty or ban, and the generators' states."""

    def __init__(self, logits: torch.Tensor, meta: SamplingMetadata, generator: torch.Generator) -> None:
        rows = set(meta.logit_bias or ()) | set(meta.banned_token_ids) | set(meta.grammar.rows if meta.grammar else ())
        rows.update(meta.penalties.rows if meta.penalties is not None else ())
        self.rows = sorted(rows)
        self.logits = logits[self.rows].clone() if self.rows else None
        self.generators = [(g, g.get_state()) for g in (generator, *meta.generators.values())]

    def restore(self, logits: torch.Tensor) -> None:
        if self.logits is not None:
            logits[self.rows] = self.logits
        for generator, state in self.generators:
            generator.set_state(state)


def _process(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """In place: the grammar's mask, logit bias, penalties and bans."""
    if meta.grammar is not None:
        _apply_grammar(logits, meta.grammar)
    for row, bias in (meta.logit_bias or {}).items():
        logits[row, list(bias)] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    if meta.penalties is not None:
        _apply_penalties(logits, meta.penalties)
    for row, token_ids in meta.banned_token_ids.items():
        logits[row, token_ids] = float("-inf")


def _distribution(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution sampling draws from: temperature (greedy rows at 1), top-k, top-p, then min-p."""
    logits = logits / torch.where(meta.temperature == 0, 1.0, meta.temperature).unsqueeze(1)
    if meta.top_k is not None:
        logits = _apply_top_k(logits, meta.top_k)
    if meta.top_p is not None:
        logits = _apply_top_p(logits, meta.top_p)
    probs = torch.softmax(logits, dim=-1)
    if meta.min_p is not None:
        probs = probs.masked_fill(probs < meta.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _apply_grammar(logits: torch.Tensor, grammar: GrammarRows) -> None:
    """In place: every token the grammar does not allow gets -inf (tokens past the mask's words too)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((grammar.packed.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    rows = torch.tensor(grammar.rows, device=logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def _apply_penalties(logits: torch.Tensor, penalties: Penalties) -> None:
    """In place: logits -= presence * [count > 0] + frequency * count over generated tokens; then a seen
    token's logit is divided by the repetition penalty if positive, multiplied if negative."""
    vocab, device = logits.shape[-1], logits.device
    rows = torch.tensor(penalties.rows, device=device)
    counts = torch.stack([torch.bincount(torch.tensor(ids, dtype=torch.long, device=device), minlength=vocab)[:vocab]
                          for ids in penalties.output_token_ids]).to(logits.dtype)
    seen = torch.zeros(len(penalties.rows), vocab, dtype=torch.bool, device=device)
    for i, ids in enumerate(penalties.seen_token_ids):
        seen[i, ids] = True
    selected = logits[rows]
    selected -= penalties.presence.unsqueeze(1) * (counts > 0) + penalties.frequency.unsqueeze(1) * counts
    repetition = penalties.repetition.unsqueeze(1)
    selected = torch.where(seen, torch.where(selected > 0, selected / repetition, selected * repetition), selected)
    logits[rows] = selected


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab))
    kth_largest = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the top token always stays).
    drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p.unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
