"""The paged KV cache: the pages' bookkeeping (`pages`: allocation, reference counts, prefix caching), their
memory (`allocation`: each attention layer's cache tensor in its backend's layout, and how many pages a budget
holds) and their dtype (`dtype`: `--kv-cache-dtype` and fp8 scales).

fw's word is *page*: `--kv-cache-page-size` tokens of K and V for every layer. vLLM's name, *block*, stays where
users and plugins already read it (renaming would break them): `--num-kv-blocks`, `AttentionMetadata.block_tables`,
`AttentionBackend.kv_cache_shape(num_blocks, ...)` and a sequence's `block_table` all count pages."""
