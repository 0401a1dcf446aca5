"""Grammar backends (structured output) live here; see the grammar-backend contract in fw.plugins."""
