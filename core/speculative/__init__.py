"""Speculative decoding: the proposer contract a `proposer` plugin implements (the public plugin API),
`--speculative-config` (fw.speculative.config), the rejection rule (fw.speculative.rejection) and the
engine's speculator (fw.speculative.service). See docs/speculative.md."""

from fw.speculative.contract import Draft, DraftRequest, Proposer, ProposerContext

__all__ = ["Draft", "DraftRequest", "Proposer", "ProposerContext"]
