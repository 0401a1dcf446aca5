"""The engine: requests, scheduler, model runner, detokenizer, outputs; the paged KV cache it schedules is fw.kv_cache."""
