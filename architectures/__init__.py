"""Built-in architecture plugins, one file per model family."""
