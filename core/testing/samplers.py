"""The sampler suite: what every sampler must guarantee whatever it computes.

- batch invariance: a row's result does not depend on the other rows of the batch;
- seed determinism: rows with seeded generators give the same result on a rerun;
- masking: a token at -inf (a grammar or `allowed_token_ids` forbade it) stays forbidden, and
  a final choice never picks it;
- identity when inactive (always-on stages): rows whose parameters do not activate the stage
  come out bit-identical, because the pipeline runs a stage on the whole batch when any row
  needs it.

Stages are driven with parameters that activate them: the `active_params` option (a
`SamplingParams`), else the first of the kit's standard settings (temperature, top-k, ...)
the stage's `is_active` accepts. Per-request stages get the request parameters `args` (default
`{}`; the schema's defaults are filled in, and `prepare` runs with the kit's tokenizer)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import jsonschema
import torch

from fw.sampling.batch import SamplingBatch
from fw.sampling.params import SamplingParams
from fw.testing.sequences import FakeSequence as Row
from fw.testing.suite import Case, SuiteTest

OPTIONS = frozenset({"active_params", "args"})

VOCAB = 64
EOS = 2
# parameter settings that activate the built-in stages; tried in order for any stage
STANDARD_ACTIVE: dict[str, dict] = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.5),
    "min_p": dict(min_p=0.1),
    "penalties": dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5),
    "logit_bias": dict(logit_bias={3: 5.0, 9: -4.0}),
    "min_tokens": dict(min_tokens=40, max_tokens=50),
    "allowed_token_ids": dict(allowed_token_ids=[1, 3, 5, 9, 11, 40]),
}
HISTORIES = [[1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [1, 3, 3, 9, 30, 2, 11], [1, 40, 41, 42, 40, 41]]


def _batch(rows: list[Row]):
    return SamplingBatch(rows, VOCAB, torch.device("cpu"), frozenset({EOS}))


def _rows(params: list, seeds: list[int | None]) -> list[Row]:
    """Fresh rows (fresh generators: a rerun draws the same numbers) over the standard histories."""
    rows = []
    for i, (p, seed) in enumerate(zip(params, seeds)):
        history = HISTORIES[i % len(HISTORIES)]
        gen = None if seed is None else torch.Generator().manual_seed(seed + len(history) - 3)
        rows.append(Row(p, list(history), num_prompt_tokens=3, generator=gen))
    return rows


def _logits(rows: int, seed: int = 0, masked: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=gen) * 3
    if masked:  # a grammar's mask: every third token forbidden, and token 40 (allowed otherwise)
        logits[:, ::3] = float("-inf")
        logits[:, 40] = float("-inf")
    return logits


def _describe(params) -> str:
    default = SamplingParams()
    fields = [f"{k}={v}" for k, v in vars(params).items()
              if k not in ("samplers", "extra_args") and v != getattr(default, k)]
    if params.extra_args:
        fields.append(f"extra_args={params.extra_args}")
    return ",".join(fields).replace(" ", "") or "defaults"


# -- the suite --------------------------------------------------------------------------------------------

def tests(spec: Any, options: dict) -> list[SuiteTest]:
    if spec.role == "choice":
        return _choice_tests(spec)
    if spec.per_request:
        return _per_request_tests(spec, options)
    return _stage_tests(spec, options)


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal within float rounding, with -inf exactly where the other has it."""
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    inf_got, inf_want = torch.isneginf(got), torch.isneginf(want)
    if not torch.equal(inf_got, inf_want):
        tokens = (inf_got ^ inf_want).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: -inf at different tokens ([row, token]: {tokens})")
    finite = ~inf_want
    diff = (got[finite] - want[finite]).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    if worst > 1e-5 * max(1.0, float(want[finite].abs().max()) if diff.numel() else 1.0) or diff.isnan().any():
        raise AssertionError(f"{what}: worst difference {worst:.4g}")


# always-on stages

def _stage_tests(spec: Any, options: dict) -> list[SuiteTest]:
    stage = spec.factory()
    active = options.get("active_params")
    candidates = [active] if active is not None else [SamplingParams(**kw) for kw in STANDARD_ACTIVE.values()]
    found = next((p for p in candidates if stage.is_active(p)), None)
    neutral = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    inactive_too = [p for p in neutral if stage.is_active(p)]
    skip = None
    if found is None:
        skip = (f"none of the kit's standard settings activates stage {spec.name!r}; pass "
                f"active_params=SamplingParams(...) that does" if active is None else
                f"active_params does not activate stage {spec.name!r} (is_active returned False)")
    case = Case(f"{spec.name}-" + (_describe(found) if found is not None else "inactive"), {"params": found}, skip)
    identity_case = case if not inactive_too else Case(
        case.id, case.data, f"stage {spec.name!r} is active for default parameters ({_describe(inactive_too[0])})")

    def run(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        with torch.inference_mode():
            out = spec.factory().apply(logits.clone(), _batch(rows))
        return out

    def identity(c: Case) -> None:
        params = [c.data["params"], *neutral]
        logits = _logits(3)
        out = run(logits, _rows(params, [1, 2, None]))
        for row in (1, 2):
            if not torch.equal(out[row], logits[row]):
                raise AssertionError(f"{c.id}: row {row} ({_describe(params[row])}) does not activate the stage "
                                     f"but its logits changed (worst {float((out[row] - logits[row]).abs().max()):.4g})")

    def invariance(c: Case) -> None:
        p = c.data["params"]
        params = [p, SamplingParams(temperature=1.0), copy.deepcopy(p)]
        logits = _logits(3, seed=1)
        together = run(logits, _rows(params, [5, 6, 7]))
        for row in range(3):
            alone = run(logits[row:row + 1], [_rows(params, [5, 6, 7])[row]])
            _same(together[row:row + 1], alone, f"{c.id}: row {row} in a batch of 3 vs alone")

    def determinism(c: Case) -> None:
        params = [c.data["params"]] * 3
        logits = _logits(3, seed=2)
        first, second = run(logits, _rows(params, [11, 12, 13])), run(logits, _rows(params, [11, 12, 13]))
        _same(second, first, f"{c.id}: seeded rerun")

    def masking(c: Case) -> None:
        params = [c.data["params"]] * 3
        logits = _logits(3, seed=3, masked=True)
        out = run(logits, _rows(params, [21, 22, 23]))
        _check_masked(out, logits, c.id)

    return [
        SuiteTest("test_identity_when_inactive", identity, [identity_case], "Rows that do not activate it are unchanged."),
        SuiteTest("test_batch_invariance", invariance, [case], "A row's result does not depend on the others."),
        SuiteTest("test_seed_determinism", determinism, [case], "Seeded rows give the same result twice."),
        SuiteTest("test_masking", masking, [case], "Tokens at -inf stay at -inf."),
    ]


def _check_masked(out: torch.Tensor, logits: torch.Tensor, case_id: str) -> None:
    if out.isnan().any():
        raise AssertionError(f"{case_id}: NaN in the output logits")
    revived = torch.isneginf(logits) & ~torch.isneginf(out)
    if revived.any():
        raise AssertionError(f"{case_id}: masked (-inf) tokens became possible again ([row, token]: "
                             f"{revived.nonzero()[:5].tolist()})")
    dead = torch.isneginf(out).all(dim=1)
    if dead.any():
        raise AssertionError(f"{case_id}: rows {dead.nonzero().flatten().tolist()} have no possible token left")


# per-request stages

def _per_request_tests(spec: Any, options: dict) -> list[SuiteTest]:
    raw_args = dict(options.get("args") or {})
    case = Case(f"{spec.name}-" + (",".join(f"{k}={v}" for k, v in sorted(raw_args.items())).replace(" ", "")
                                   or "defaults"), {"args": raw_args})

    def prepared(stage) -> Any:
        args = copy.deepcopy(raw_args)
        if spec.parameters is not None:
            cls = jsonschema.validators.validator_for(spec.parameters, default=jsonschema.Draft202012Validator)
            error = jsonschema.exceptions.best_match(cls(spec.parameters).iter_errors(args))
            if error is not None:
                raise AssertionError(f"{case.id}: the args option fails {spec.name}'s parameter schema: {error.message}")
            for key, prop in spec.parameters.get("properties", {}).items():
                if isinstance(prop, dict) and "default" in prop and key not in args:
                    args[key] = copy.deepcopy(prop["default"])
        prepare = getattr(stage, "prepare", None)
        if prepare is not None:
            from fw.testing.models import tokenizer  # here: transformers (1 s), only for a stage that prepares

            args = prepare(args, tokenizer())
        return args

    def run(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        stage = spec.factory()
        args = [prepared(stage) for _ in rows]
        with torch.inference_mode():
            return stage.apply(logits.clone(), _batch(rows), args)

    params = [SamplingParams(temperature=1.0, samplers=[spec.name]), SamplingParams(temperature=0.0,
                                                                                      samplers=[spec.name])]

    def invariance(c: Case) -> None:
        ps = [params[0], params[1], params[0]]
        logits = _logits(3, seed=1)
        together = run(logits, _rows(ps, [5, 6, 7]))
        for row in range(3):
            alone = run(logits[row:row + 1], [_rows(ps, [5, 6, 7])[row]])
            _same(together[row:row + 1], alone, f"{c.id}: row {row} in a batch of 3 vs alone")

    def determinism(c: Case) -> None:
        ps = [params[0]] * 3
        logits = _logits(3, seed=2)
        _same(run(logits, _rows(ps, [11, 12, 13])), run(logits, _rows(ps, [11, 12, 13])), f"{c.id}: seeded rerun")

    def masking(c: Case) -> None:
        logits = _logits(3, seed=3, masked=True)
        _check_masked(run(logits, _rows([params[0]] * 3, [21, 22, 23])), logits, c.id)

    return [
        SuiteTest("test_batch_invariance", invariance, [case], "A row's result does not depend on the others."),
        SuiteTest("test_seed_determinism", determinism, [case], "Seeded rows give the same result twice."),
        SuiteTest("test_masking", masking, [case], "Tokens at -inf stay at -inf."),
    ]


# final-choice samplers

def _choice_tests(spec: Any) -> list[SuiteTest]:
    sampled = SamplingParams(temperature=1.0, seed=1)
    greedy = SamplingParams(temperature=0.0)
    cases = [Case(f"{spec.name}-sampled", {"params": sampled}), Case(f"{spec.name}-greedy", {"params": greedy})]

    def choose(logits: torch.Tensor, rows: list[Row]) -> list[int]:
        with torch.inference_mode():
            tokens = spec.factory().choose(logits.clone(), _batch(rows))
        if tuple(tokens.shape) != (len(rows),):
            raise AssertionError(f"{spec.name}: choose returned shape {tuple(tokens.shape)} for {len(rows)} rows")
        return tokens.tolist()

    def seeds(n: int) -> list[int]:
        return [100 + i for i in range(n)]

    def determinism(c: Case) -> None:
        p = c.data["params"]
        logits = _logits(8, seed=4)
        first = choose(logits, _rows([p] * 8, seeds(8)))
        second = choose(logits, _rows([p] * 8, seeds(8)))
        if first != second:
            raise AssertionError(f"{c.id}: the same seeds chose {first}, then {second}")
        if p.greedy and first != logits.argmax(dim=1).tolist():
            raise AssertionError(f"{c.id}: greedy rows chose {first}, the argmax is {logits.argmax(dim=1).tolist()}")

    def invariance(c: Case) -> None:
        p = c.data["params"]
        logits = _logits(3, seed=5)
        ps = [p, SamplingParams(temperature=0.5, seed=9), p]
        together = choose(logits, _rows(ps, seeds(3)))
        alone = [choose(logits[i:i + 1], [_rows(ps, seeds(3))[i]])[0] for i in range(3)]
        if together != alone:
            raise AssertionError(f"{c.id}: rows chose {together} in one batch but {alone} one at a time")

    def masking(c: Case) -> None:
        p = c.data["params"]
        logits = _logits(32, seed=6, masked=True)
        chosen = choose(logits, _rows([p] * 32, seeds(32)))
        bad = [(row, t) for row, t in enumerate(chosen) if torch.isneginf(logits[row, t])]
        if bad:
            raise AssertionError(f"{c.id}: chose masked (-inf) tokens ([row, token]: {bad[:5]})")

    return [
        SuiteTest("test_seed_determinism", determinism, cases, "The same seeds choose the same tokens."),
        SuiteTest("test_batch_invariance", invariance, cases, "A row's choice does not depend on the others."),
        SuiteTest("test_masking", masking, cases, "A -inf token is never chosen."),
    ]
