"""The rejection rule of speculative decoding: which draft tokens to keep so that the output is distributed
exactly as the target model's sampling would make it (Leviathan et al. 2023; Chen et al. 2023).

At each draft position j the target's fully processed distribution p_j (every sampler stage, the grammar
mask) is known from the verify pass. Draft token x_j, drawn by the proposer from q_j, is accepted with
probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the token is drawn from the residual
norm(max(p_j - q_j, 0)) and the rest of the draft is dropped; when every draft token is accepted, one more
("bonus") token is drawn from p_k. A deterministic proposer's q_j is a point mass: x_j is accepted with
probability p_j(x_j), and a rejection draws from p_j with x_j removed. Greedy requests have a point mass
p_j at the argmax: a draft token is kept iff it is the argmax.

For deterministic drafts the engine uses an equivalent coupling (`accepted_prefix`): it draws y_j from p_j
at every position with the request's own final-choice sampler, exactly as a step without speculation
would, keeps x_j iff y_j == x_j, and emits the first y_j that differs. P(y_j == x_j) = p_j(x_j), and given
y_j != x_j, y_j is distributed as p_j without x_j: the rule above. A seeded request then draws the same
random numbers for the same tokens as without speculation (the engine rewinds what the unused positions
drew), so its output does not depend on whether its steps speculated.
"""

from __future__ import annotations

from typing import Sequence

import torch


def accepted_prefix(sampled: Sequence[int], draft: Sequence[int]) -> int:
    """How many leading draft tokens the coupled rule keeps: positions where the target's own draw
    equals the draft token, up to the first that does not. The emitted tokens are sampled[:n + 1]."""
    n = 0
    for y, x in zip(sampled, draft):
        if y != x:
            break
        n += 1
    return n


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) over the last dimension; p itself where the two are equal (nothing is left)."""
    r = (p - q).clamp_min_(0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


def verify(p: torch.Tensor, draft: Sequence[int], q: torch.Tensor | None = None,
           generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """The rejection rule on explicit distributions.

    `p`: [k + 1, V] the target's probabilities at the k draft positions and the one after; `draft`: the k
    draft tokens; `q`: [k, V] the distributions they were drawn from, None for point masses. Returns
    (emitted tokens, number of draft tokens accepted): the accepted draft tokens, then one token from the
    residual at the first rejection or, with all accepted, from p[k]."""
    k = len(draft)
    if p.shape[0] < k + 1:
        raise ValueError(f"p has {p.shape[0]} rows for {k} draft tokens; it needs {k + 1}")
    device = p.device
    uniforms = torch.rand(k, generator=generator, device=device, dtype=torch.float64) if k else None
    for j, x in enumerate(draft):
        px = float(p[j, x])
        qx = 1.0 if q is None else float(q[j, x])
        if qx > 0 and float(uniforms[j]) < min(1.0, px / qx):
            continue
        if q is None:
            point = torch.zeros_like(p[j])
            point[x] = 1.0
            rest = residual(p[j], point)
        else:
            rest = residual(p[j], q[j].to(p.dtype))
        token = int(torch.multinomial(rest, 1, generator=generator))
        return [int(t) for t in draft[:j]] + [token], j
    bonus = int(torch.multinomial(p[k], 1, generator=generator))
    return [int(t) for t in draft] + [bonus], k


__all__ = ["accepted_prefix", "residual", "verify"]
