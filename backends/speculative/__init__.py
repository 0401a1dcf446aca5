"""Built-in speculative-decoding proposers (kind `proposer`): ngram and draft_model; the contract is
fw.speculative."""
