"""The fw plugin module: XTC ("exclude top choices") as a per-request sampler stage.

With probability `probability` at each step, every token whose probability is at least
`threshold` is removed except the least probable of them, so the model leaves its most
predictable continuations while a viable one always remains (when fewer than two tokens reach
the threshold nothing changes). A request names it with its parameters::

    SamplingParams(samplers=[{"name": "xtc", "threshold": 0.1, "probability": 0.5}], seed=7)
    # on the server: extra_body={"samplers": [{"name": "xtc", "threshold": 0.1, "probability": 0.5}]}

The per-step draw comes from the row's seeded generator when the request has a seed, so a
seeded request gives the same tokens whatever else shares its batch. It runs after the
truncation stages (order 80, after min_p), on the probabilities they leave."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fw.plugins import SamplerSpec, hookimpl
from fw.sampling.batch import SamplingBatch

FW_PLUGIN_API_VERSION = "1.0"

# Defaults: the values XTC's author suggests as a starting point.
PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "threshold": {"type": "number", "minimum": 0, "maximum": 1, "default": 0.1,
                      "description": "tokens at least this probable are top choices; above 0.5 XTC does nothing"},
        "probability": {"type": "number", "minimum": 0, "maximum": 1, "default": 0.5,
                        "description": "chance per step that the top choices are removed"},
    },
    "additionalProperties": False,
}


@dataclass(frozen=True)
class XtcParams:
    threshold: float
    probability: float

    @property
    def off(self) -> bool:
        """No step can act: at most one token can reach a threshold above 0.5 (as llama.cpp)."""
        return self.probability <= 0.0 or self.threshold > 0.5


def fires(p: XtcParams, generator: torch.Generator | None) -> bool:
    """This step's draw: one uniform number from the row's generator (else the global one)."""
    if p.off:
        return False
    if generator is None:
        u = torch.rand(())
    else:
        u = torch.rand((), generator=generator, device=generator.device)
    return float(u) < p.probability


class Xtc:
    def prepare(self, args: dict[str, Any], tokenizer: Any) -> XtcParams:
        for name in ("threshold", "probability"):
            if not math.isfinite(args[name]):
                raise ValueError(f"{name} must be a finite number, got {args[name]}")
        return XtcParams(float(args["threshold"]), float(args["probability"]))

    def apply(self, logits: torch.Tensor, batch: SamplingBatch, params: list[XtcParams]) -> torch.Tensor:
        acting = [row for row, (p, gen) in enumerate(zip(params, batch.generators)) if fires(p, gen)]
        if not acting:
            return logits
        index = torch.tensor(acting, device=logits.device)
        rows = logits[index]
        probs = rows.softmax(dim=-1)
        threshold = torch.tensor([params[r].threshold for r in acting], dtype=probs.dtype,
                                 device=logits.device).unsqueeze(1)
        top = probs >= threshold
        # The least probable top choice stays (ties with it too); with fewer than two top
        # choices nothing is above it, so nothing is removed.
        least = probs.masked_fill(~top, math.inf).amin(dim=-1, keepdim=True)
        logits[index] = rows.masked_fill(top & (probs > least), float("-inf"))
        return logits


@hookimpl
def fw_register_samplers(register) -> None:
    register(SamplerSpec("xtc", Xtc, order=80, per_request=True, parameters=PARAMETERS,
                         description="XTC: sometimes remove every top choice but the least probable"))
