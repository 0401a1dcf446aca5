"""The built-in sampler plugin (kind `sampler`): the logits stages and the default final choice."""
