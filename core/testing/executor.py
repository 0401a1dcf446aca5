"""The executor suite: an engine whose second rank the executor starts gives the tokens of one process.

The executor starts rank 1 of a --tensor-parallel-size 2 engine on a tiny random Llama (fp32, on
the CPU: gloo); the greedy tokens must equal those of one process and the logprobs agree within
LOGPROB_TOLERANCE (the ranks sum partial products in another order). Every handle it returned must
be a `fw.plugins.WorkerProcess`, and after the engine closes each must have ended with exit code 0:
no rank outlives its engine. An executor that runs one rank, or whose ranks a launcher starts, is
skipped with the reason (run the suite under that launcher)."""

from __future__ import annotations

from typing import Any

from fw import LLM, SamplingParams
from fw.plugins.executor import WorkerProcess
from fw.plugins.manager import PluginManager
from fw.testing.architecture import checkpoint
from fw.testing.suite import Case, SuiteTest

OPTIONS = frozenset({"max_new_tokens"})
PROMPTS = ["The quick brown fox jumps over", "def add(a, b):"]
LOGPROB_TOLERANCE = 1e-4
ARCHITECTURE = "LlamaForCausalLM"  # 4 query and 2 KV heads: both split in two


def tests(spec: Any, options: dict) -> list[SuiteTest]:
    skip = ("it runs one rank" if spec.max_world_size is not None and spec.max_world_size < 2 else
            "a launcher starts its ranks: run the suite under that launcher" if not spec.starts_processes else None)
    steps = int(options.get("max_new_tokens") or 8)
    return [SuiteTest("test_two_ranks_give_the_tokens_of_one_process",
                      lambda case: run_case(spec, case, steps), [Case("tp2", {}, skip)],
                      "Rank 1, started by the executor, joins; tokens match one process; no rank outlives the engine.")]


def plugins_with(spec: Any) -> PluginManager:
    """A private plugin manager with the installed plugins plus `spec` (replacing one of the same name)."""
    manager = PluginManager().load()
    manager.registry("executor").add(spec, "fw.testing", "fw.testing (conformance suite)", override=True)
    return manager


def run_case(spec: Any, case: Case, steps: int) -> None:
    path = str(checkpoint(ARCHITECTURE))
    plugins = plugins_with(spec)
    options = dict(plugins=plugins, dtype="float32", device="cpu", num_kv_blocks=64, kv_cache_page_size=4)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=1)
    want = [o.outputs[0] for o in LLM(path, **options).generate(PROMPTS, params)]
    two = LLM(path, tensor_parallel_size=2, distributed_executor_backend=spec.name, **options)
    cluster = two.engine.cluster
    procs = dict(cluster.procs)
    try:
        if set(procs) != {1}:
            raise AssertionError(f"{case.id}: start_workers returned ranks {sorted(procs)}, expected [1]")
        if not isinstance(procs[1], WorkerProcess):
            raise AssertionError(f"{case.id}: rank 1's handle ({type(procs[1]).__name__}) lacks what "
                                 f"fw.plugins.WorkerProcess names (pid, exitcode, sentinel, is_alive, join, "
                                 f"terminate, kill)")
        got = [o.outputs[0] for o in two.generate(PROMPTS, params)]
    finally:
        cluster.close()
    for prompt, a, b in zip(PROMPTS, want, got):
        if a.token_ids != b.token_ids:
            raise AssertionError(f"{case.id}: prompt {prompt!r}: two ranks gave {b.token_ids}, one process "
                                 f"{a.token_ids}")
        worst = max(abs(x[t].logprob - y[t].logprob) for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids))
        if worst > LOGPROB_TOLERANCE:
            raise AssertionError(f"{case.id}: prompt {prompt!r}: logprobs differ by {worst:.3g} "
                                 f"(tolerance {LOGPROB_TOLERANCE:g})")
    codes = {rank: proc.exitcode for rank, proc in procs.items()}
    if any(code != 0 for code in codes.values()):
        raise AssertionError(f"{case.id}: after the engine closed, the ranks' exit codes are {codes} (expected 0: "
                             f"each leaves its step loop when rank 0 says stop)")
