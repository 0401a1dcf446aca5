"""`fw doctor`: why a configuration would or would not start here, read from the engine plan (fw.plan), the
installed plugins and the machine, without starting an engine."""
