"""Benchmarks as commands (`fw bench ...`), not timed tests.

`serve_load` drives any OpenAI-compatible server with synthetic streaming
requests and measures each one; `prompts` makes the synthetic prompts;
`report` turns the measurements into statistics, a table and a JSON file.
None of these imports the engine: the load generator must run on a machine
that only has the client side installed, against fw, vLLM, TGI or SGLang.

`offline` (`fw bench latency`, `fw bench throughput`) is the exception: it
runs fw's `LLM` in-process, and `hf_baseline` runs the same workload on
transformers for comparison.
"""

from fw.errors import FwError


class BenchError(FwError):
    """The benchmark cannot start: the server is unreachable or the options contradict each other."""

    status_code = 400
    error_type = "invalid_request_error"
