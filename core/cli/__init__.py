"""The `fw` command line."""
