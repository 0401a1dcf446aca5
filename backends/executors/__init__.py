"""Built-in executors (kind `executor`): uni, mp and external_launcher, how the ranks of a
tensor-parallel engine start; the contract is fw.plugins.executor (fw.plugins)."""
