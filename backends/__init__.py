"""Built-in backend plugins, one folder per kind: attention, MoE kernels, sampling, grammar, tool-call
parsers, speculative proposers."""
