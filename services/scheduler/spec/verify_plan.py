"""How many drafts each request verifies, from the confidence head (`compact` verify mode).

Prefix survival s_k = c_1 * ... * c_k estimates the chance that drafts 1..k all survive, so
verifying d_k adds s_k expected tokens. Given a batch-wide budget of E extra verify rows (beyond
each request's anchor row), the rows with the highest s_k are the best buy; since s_k never grows
along a request's chain, the chosen rows of each request form a prefix, as verification needs.

Lossless as long as E does not depend on this block's drafts: request b includes d_k iff s_k ranks
within the top E, and s_k depends on d_1..d_{k-1} only (c_k sees the previous token, not its own),
so the cut is a stopping time of the draft. Choosing E from the same block's survivals would let
d_k's own value (through s_{k+1}) move the cut; `best_extra_rows` is therefore meant to run on the
previous step's confidences (SGLang likewise lags them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def prefix_survival(confidence: torch.Tensor) -> torch.Tensor:
    return confidence.float().clamp(0.0, 1.0).cumprod(dim=1)  # [B, gamma]


def verify_lengths(confidence: torch.Tensor, num_extra_rows: int) -> torch.Tensor:
    """confidence f32 [B, gamma] -> int64 [B], drafts to verify per request, summing to min(E, B * gamma).

    Ties keep request order, then position order (a stable sort of the row-major survivals), so a
    request's chosen rows stay a prefix even when survivals are equal.
    """
    batch, gamma = confidence.shape
    order = prefix_survival(confidence).flatten().argsort(descending=True, stable=True)  # [B * gamma]
    chosen = order[: max(0, min(num_extra_rows, batch * gamma))] // gamma  # request of each chosen row
    return torch.zeros(batch, dtype=torch.int64, device=confidence.device).scatter_add_(
        0, chosen, torch.ones_like(chosen)
    )


def best_extra_rows(confidence: torch.Tensor, step_seconds: Callable[[int], float]) -> int:
    """The E that maximises expected committed tokens per second, (B + top-E survival sum) / t(B + E).

    `step_seconds(num_rows)`: measured verify-step time for that many rows. Reads survivals on the
    host (one sync): run it on the previous step's confidences, see the module docstring.
    """
    batch, gamma = confidence.shape
    ranked = prefix_survival(confidence).flatten().sort(descending=True).values.double().cpu()
    expected = batch + torch.cat((torch.zeros(1, dtype=torch.float64), ranked.cumsum(0)))  # [B * gamma + 1]
    rate = [float(expected[extra]) / step_seconds(batch + extra) for extra in range(batch * gamma + 1)]
    return max(range(len(rate)), key=rate.__getitem__)
