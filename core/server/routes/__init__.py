"""The HTTP routes, one module per API area: chat, completions, embeddings, LoRA adapters, the UI, and the rest
(models, health, metrics, tokenize). Each reads the engine through the `ServerState` facade (fw.server.state)."""
