"""The engine: requests, scheduler, paged KV blocks, model runner, outputs."""
