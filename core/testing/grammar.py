"""The grammar-backend suite: mask, accept, rollback and termination on small constraints.

With the kit's offline tokenizer (and a logits width five ids larger than its vocabulary, ids a
grammar must never allow), each constraint kind the spec declares is compiled and a matcher is
walked along the tokens of a valid text: every token must be allowed by the mask when it comes
and accepted; the stop token must be refused before the text is complete and allowed after it,
and accepting it terminates the matcher. A token that cannot start the text must be masked out
and refused by `accept_token` without changing the state; `rollback` must restore the masks."""

from __future__ import annotations

import json
from typing import Any

import torch

from fw.grammar import Constraint, GrammarTokenizer, allocate_token_bitmask, bitmask_to_bool
from fw.testing.models import tokenizer
from fw.testing.suite import Case, SuiteTest, availability

OPTIONS = frozenset({"constraint_kinds"})
EXTRA_IDS = 5  # the logits are wider than the vocabulary by this many never-allowed ids

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
# kind -> (constraint value, valid texts (compact first: backends differ in the whitespace they allow),
#          a token text that cannot start the output)
CONSTRAINTS: dict[str, tuple[Any, list[str], str]] = {
    "json_schema": (json.dumps(SCHEMA, separators=(",", ":")), ['{"name":"fw","n":42}', '{"name": "fw", "n": 42}'],
                    "x"),
    "json_object": (None, ['{"key":"value"}', '{"key": "value"}'], "x"),
    "regex": (r"[a-z]{3}-[0-9]{3}", ["abc-123"], "9"),
    "choice": (("yes", "no", "maybe"), ["maybe"], "x"),
}


def tests(spec: Any, options: dict) -> list[SuiteTest]:
    why = availability(spec)
    chosen = options.get("constraint_kinds")
    cases = []
    for kind in CONSTRAINTS:
        skip = why or (None if kind in spec.constraint_kinds else
                       f"{kind} not among the backend's constraint kinds ({', '.join(spec.constraint_kinds)})")
        if skip is None and chosen is not None and kind not in chosen:
            skip = f"{kind} left out by the suite's constraint_kinds option"
        cases.append(Case(kind, {"kind": kind}, skip))
    state: dict[str, Any] = {}

    def compiler():
        if "compiler" not in state:
            tok = tokenizer()
            state["tok"] = GrammarTokenizer(tok, len(tok) + EXTRA_IDS, frozenset({tok.eos_token_id}))
            state["compiler"] = spec.factory(state["tok"])
        return state["compiler"], state["tok"]

    def walk(case: Case):
        """(matcher at the start, the tokens of the first valid text the grammar takes, grammar tokenizer)."""
        comp, gtok = compiler()
        kind = case.data["kind"]
        value, texts, _ = CONSTRAINTS[kind]
        if ("compiled", kind) not in state:  # compiled grammars are immutable and shared, as in the engine
            state["compiled", kind] = comp.compile(Constraint(kind, value))
        compiled = state["compiled", kind]
        refused = []
        for text in texts:
            ids = gtok.hf_tokenizer.encode(text, add_special_tokens=False)
            matcher = compiled.matcher()
            taken = 0
            while taken < len(ids) and matcher.accept_token(ids[taken]):
                taken += 1
            if taken == len(ids):
                return compiled, ids, gtok
            refused.append(f"{text!r} at token {taken} ({gtok.hf_tokenizer.decode(ids[:taken + 1])!r})")
        raise AssertionError(f"{case.id}: the grammar refuses every valid text: {'; '.join(refused)}")

    def allowed(matcher, gtok) -> torch.Tensor:
        bitmask = allocate_token_bitmask(1, gtok.vocab_size)
        matcher.fill_bitmask(bitmask, 0)
        return bitmask_to_bool(bitmask, gtok.vocab_size)[0]

    def accept(case: Case) -> None:
        compiled, ids, gtok = walk(case)
        eos = gtok.eos_token_id
        matcher = compiled.matcher()
        for step, token in enumerate(ids):
            mask = allowed(matcher, gtok)
            if not mask[token]:
                raise AssertionError(f"{case.id}: step {step}: the mask forbids token {token} "
                                     f"({gtok.hf_tokenizer.decode([token])!r}) of a valid text")
            if mask[eos]:
                raise AssertionError(f"{case.id}: step {step}: the stop token is allowed before the text is complete")
            if mask[-EXTRA_IDS:].any():
                raise AssertionError(f"{case.id}: step {step}: ids beyond the vocabulary are allowed")
            if matcher.is_terminated():
                raise AssertionError(f"{case.id}: step {step}: terminated before the text is complete")
            if not matcher.accept_token(token):
                raise AssertionError(f"{case.id}: step {step}: accept_token refused an allowed token {token}")
        if not allowed(matcher, gtok)[eos]:
            raise AssertionError(f"{case.id}: the stop token is not allowed after a complete text")
        if not matcher.accept_token(eos) or not matcher.is_terminated():
            raise AssertionError(f"{case.id}: accepting the stop token after a complete text did not terminate")

    def refuse(case: Case) -> None:
        compiled, _, gtok = walk(case)
        bad_text = CONSTRAINTS[case.data["kind"]][2]
        bad = gtok.hf_tokenizer.convert_tokens_to_ids(bad_text)
        matcher = compiled.matcher()
        before = allowed(matcher, gtok)
        if before[bad]:
            raise AssertionError(f"{case.id}: the start mask allows {bad_text!r}, which cannot start a valid text")
        if matcher.accept_token(bad):
            raise AssertionError(f"{case.id}: accept_token took {bad_text!r}, which the grammar forbids")
        if not torch.equal(allowed(matcher, gtok), before):
            raise AssertionError(f"{case.id}: a refused token changed the matcher's mask")

    def rollback(case: Case) -> None:
        compiled, ids, gtok = walk(case)
        matcher = compiled.matcher()
        masks = [allowed(matcher, gtok)]
        k = min(3, len(ids))
        for token in ids[:k]:
            matcher.accept_token(token)
            masks.append(allowed(matcher, gtok))
        matcher.rollback(1)
        if not torch.equal(allowed(matcher, gtok), masks[k - 1]):
            raise AssertionError(f"{case.id}: rollback(1) after {k} tokens did not restore the mask")
        matcher.rollback(k - 1)
        if not torch.equal(allowed(matcher, gtok), masks[0]):
            raise AssertionError(f"{case.id}: rolling back every token did not restore the start mask")
        for step, token in enumerate(ids):
            if not matcher.accept_token(token):
                raise AssertionError(f"{case.id}: after rollback, token {step} of the valid text was refused")
        if not matcher.accept_token(gtok.eos_token_id) or not matcher.is_terminated():
            raise AssertionError(f"{case.id}: after rollback and replay, the stop token did not terminate")

    return [
        SuiteTest("test_accepts_valid_text", accept, cases,
                  "Masks allow each token of a valid text, the stop token only at its end, which terminates."),
        SuiteTest("test_refuses_invalid_token", refuse, cases, "A token that cannot start the text is masked and refused."),
        SuiteTest("test_rollback", rollback, cases, "rollback restores the masks; replaying reaches the end."),
    ]
