"""Built-in attention backends (plugin kind `attention_backend`): sdpa, cpu_paged, flex, triton, flash_attn;
the contract they implement is fw.layers.AttentionBackend."""
